"""rocdraft: one import namespace, ``rocdraft``, mapped from the top-level folders.

``rocdraft/`` -> ``rocdraft``, ``backends/`` -> ``rocdraft.backends``, and so on, so that no
generic top-level name (``backends``, ``drafter``) lands in site-packages.
"""
from setuptools import find_packages, setup

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
    install_requires=["torch>=2.4", "numpy", "safetensors", "tokenizers", "triton"],
    extras_require={
        "test": ["pytest", "hypothesis", "transformers", "ninja", "matplotlib"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["rocdraft=rocdraft.cli:main"]},
)
