"""llama.cpp at one pinned commit: its converter (convert_hf_to_gguf.py, conversion/, gguf-py) and, when asked, its
`llama-mtmd-cli`, `llama-server` and `llama-quantize` built from the same source.

The only network tamis may count on is a package registry, so the source comes from PyPI: llama-cpp-python's sdist
vendors llama.cpp whole (the converter, gguf-py and tools/mtmd). It is fetched once with pip, checked against its
sha256 and unpacked under ~/.cache/tamis-llama-cpp-<commit>/src; cmake builds into …/build beside it, so a second
export or CI rerun reuses both. The converter runs in tamis's own interpreter (its imports work with tamis's torch and
transformers; pipeline/serving/gguf_convert.py adjusts two of its checks).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ConfigError, ModelError


@dataclass(frozen=True)
class LlamaCppPin:
    """The llama.cpp commit tamis converts with, and the PyPI sdist that vendors it (CHANGELOG of 0.3.36: "update
    llama.cpp to ggml-org/llama.cpp@0c1e57098"), with the sdist's sha256."""

    commit: str
    package: str
    version: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


LLAMA_CPP = LlamaCppPin("0c1e57098", "llama-cpp-python", "0.3.36",
                        "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
VENDORED = "vendor/llama.cpp/"
TOOLS = ("llama-mtmd-cli", "llama-server", "llama-quantize")
# Static binaries, no tests/examples: the three tools and what they link, nothing else. llama-server answers over
# HTTP, where llama-mtmd-cli prints through a log that can lose its last lines at exit (llama.cpp #22142); its web UI
# would be downloaded from Hugging Face at build time (LLAMA_USE_PREBUILT_UI), so it is built without one.
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TOOLS=ON")
CONVERT_SCRIPT = Path(__file__).with_name("gguf_convert.py")


def cache_root() -> Path:
    """Where the pinned source and its build live: $TAMIS_LLAMA_CPP_CACHE, else ~/.cache/tamis-llama-cpp-<commit>."""
    return Path(os.environ.get("TAMIS_LLAMA_CPP_CACHE") or
                Path.home() / ".cache" / f"tamis-llama-cpp-{LLAMA_CPP.commit}")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_sdist(into: Path) -> Path:
    """The pinned sdist, downloaded with pip (no build, no dependencies) and checked against LLAMA_CPP.sha256."""
    cmd = [sys.executable, "-m", "pip", "download", LLAMA_CPP.requirement, "--no-binary", ":all:", "--no-deps", "-d",
           str(into)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(into.glob(f"{LLAMA_CPP.package.replace('-', '_')}-{LLAMA_CPP.version}.tar.gz"))
    if proc.returncode != 0 or not found:
        raise ModelError(f"could not download {LLAMA_CPP.requirement} (the llama.cpp source tamis converts with) from "
                         f"the package index: `{shlex.join(cmd)}` exited {proc.returncode}: {proc.stderr[-800:]}")
    got = sha256_of(found[0])
    if got != LLAMA_CPP.sha256:
        raise ModelError(f"{found[0]}: sha256 {got}, expected {LLAMA_CPP.sha256} for {LLAMA_CPP.requirement}; the "
                         "index served a different file. Check your index (pip config list) and try again")
    return found[0]


def llama_cpp_source(root: Path | None = None) -> Path:
    """The pinned llama.cpp tree (…/src), fetched and unpacked on first use."""
    from pipeline.store import atomic_dir

    src = (root or cache_root()) / "src"
    if (src / "convert_hf_to_gguf.py").is_file():
        return src
    src.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=src.parent) as tmp, atomic_dir(src) as out:
        with tarfile.open(download_sdist(Path(tmp))) as tar:
            for m in tar.getmembers():
                rel = m.name.split("/", 1)[-1]
                if rel.startswith(VENDORED) and (m.isfile() or m.isdir()):
                    m.name = rel.removeprefix(VENDORED)
                    if m.name:
                        tar.extract(m, out, filter="data")
    return src


def tool_path(name: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / "build" / "bin" / name


def build_commands(root: Path | None = None, *, jobs: int = 2) -> list[list[str]]:
    """cmake's configure and build of TOOLS from the pinned source (niced: it shares the machine)."""
    root = root or cache_root()
    return [["nice", "cmake", "-S", str(root / "src"), "-B", str(root / "build"), *CMAKE_FLAGS,
             f"-DLLAMA_BUILD_COMMIT={LLAMA_CPP.commit}"],
            ["nice", "cmake", "--build", str(root / "build"), f"-j{jobs}", "--target", *TOOLS]]


def build_hint() -> str:
    """How a user builds llama-quantize (and llama-mtmd-cli) from the pinned source, for messages."""
    return (f"build it from the same pinned source with `python -m pipeline.serving.llama_cpp` (cmake and g++; "
            f"13.5 min CPU: ~10 min on 2 free cores, 48 min on 2 busy ones; cached in {cache_root()})")


def build_tools(root: Path | None = None, *, jobs: int = 2) -> dict[str, Path]:
    """TOOLS built from the pinned source under `root` (reused when already built)."""
    root = root or cache_root()
    if all(tool_path(t, root).is_file() for t in TOOLS):
        return {t: tool_path(t, root) for t in TOOLS}
    llama_cpp_source(root)
    for cmd in build_commands(root, jobs=jobs):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ModelError(f"building llama.cpp {LLAMA_CPP.commit} failed: `{shlex.join(cmd)}` exited "
                             f"{proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}; cmake and g++ are needed "
                             "(apt-get install -y cmake g++)")
    return {t: tool_path(t, root) for t in TOOLS}


def convert(checkpoint: Path, outfile: Path, outtype: str, *, mmproj: bool, src: Path) -> None:
    """convert_hf_to_gguf.py on `checkpoint`: the text model, or with `mmproj` the vision tower and projector."""
    cmd = [sys.executable, str(CONVERT_SCRIPT), str(src), str(checkpoint), "--outfile", str(outfile),
           "--outtype", outtype, *(["--mmproj"] if mmproj else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"})  # its gguf-py, not PyPI's
    if proc.returncode != 0 or not outfile.is_file():
        raise ModelError(f"llama.cpp {LLAMA_CPP.commit}'s converter failed on {checkpoint} "
                         f"({'--mmproj' if mmproj else 'text model'}, {outtype}): "
                         f"{proc.stderr.strip().splitlines()[-1:] or proc.returncode}; full command: {shlex.join(cmd)}")


def quantize(tool: Path, src: Path, dst: Path, kind: str) -> None:
    proc = subprocess.run([str(tool), str(src), str(dst), kind], capture_output=True, text=True)
    if proc.returncode != 0 or not dst.is_file():
        raise ModelError(f"{tool} {src.name} → {kind} failed ({proc.returncode}): {proc.stderr[-800:]}")


def require_source() -> Path:
    """The pinned source, or a ConfigError that says how to provide it."""
    try:
        return llama_cpp_source()
    except ModelError as exc:
        raise ConfigError(f"--format gguf needs llama.cpp {LLAMA_CPP.commit}'s converter: {exc}") from exc


if __name__ == "__main__":  # python -m pipeline.serving.llama_cpp: build the tools (see build_hint)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name, path in build_tools().items():
        logging.getLogger(__name__).info("%s: %s", name, path)
