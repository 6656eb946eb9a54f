"""Files and folders written through pipeline.store get umask-derived modes, not mkstemp's 0600 / mkdtemp's 0700."""

import os
import stat

import pytest

from pipeline.store import append_jsonl, atomic_dir, atomic_write_text, current_umask


@pytest.fixture
def umask():
    old = os.umask(0o022)
    os.umask(old)

    def set_mask(mask: int) -> None:
        os.umask(mask)

    yield set_mask
    os.umask(old)


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.mark.parametrize("mask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700),
                                                       (0o002, 0o664, 0o775)])
def test_outputs_get_umask_derived_modes(tmp_path, umask, mask, file_mode, dir_mode):
    umask(mask)
    assert current_umask() == mask
    f = atomic_write_text(tmp_path / "out" / "label_studio_tasks.json", "[]\n")
    assert _mode(f) == file_mode
    with atomic_dir(tmp_path / "out" / "images") as tmp:
        (tmp / "a.png").write_bytes(b"x")
    assert _mode(tmp_path / "out" / "images") == dir_mode
    assert _mode(tmp_path / "out" / "images" / "a.png") == file_mode
    append_jsonl(tmp_path / "out" / "labels.jsonl", [{"a": 1}])
    assert _mode(tmp_path / "out" / "labels.jsonl") == file_mode


def test_atomic_dir_gives_what_libraries_wrote_the_usual_modes(tmp_path, umask):
    """safetensors writes through a 0600 temp file and a copy keeps its source's mode: what lands in an atomic_dir
    folder gets a plain open()'s mode (an exported model's weights as readable as its README), executables stay so."""
    import torch
    from safetensors.torch import save_file

    umask(0o022)
    with atomic_dir(tmp_path / "merged") as tmp:
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        (tmp / "sub").mkdir(mode=0o700)
        (tmp / "sub" / "copied.bin").write_bytes(b"x")
        os.chmod(tmp / "sub" / "copied.bin", 0o600)
        (tmp / "run.sh").write_text("#!/bin/sh\n")
        os.chmod(tmp / "run.sh", 0o700)
    out = tmp_path / "merged"
    assert _mode(out / "model.safetensors") == 0o644 and _mode(out / "sub" / "copied.bin") == 0o644
    assert _mode(out / "sub") == 0o755 and _mode(out / "run.sh") == 0o755
