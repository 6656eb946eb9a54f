"""Serving what the rounds trained: the export's standalone predict.py and the docs' transformers snippet answer as
`tamis predict` does, in an interpreter where tamis cannot be imported.

The project's answers are letters A..J (the digits relabelled): with the tiny tokenizer, as with SmolVLM's, every
letter answer starts with the same space token after "Assistant:", so scoring only an answer's first token gives
every answer the same probability. The new images are crops of scikit-image's photos."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import load_config
from tests.test_round_flow import write_project
from tests.test_use_model import photo_folder, read_csv, said, tamis_cli

pytestmark = pytest.mark.slow  # a two-round project (~2 min on 2 busy cores) behind every test
LETTERS = "ABCDEFGHIJ"
ROOTS = tuple(str(Path(p).resolve()) for p in (Path(__file__).parents[1], "/work/main"))
# Runs a file as __main__ with tamis's packages unimportable (the editable install's finder and the repo's path
# entries too), after checking that `import pipeline` fails; prints the tamis modules it loaded on the last line.
LAUNCH = f"""
import json, runpy, sys
sys.path = [p for p in sys.path if p.rstrip("/") not in {ROOTS!r} and p not in ("", ".")]
sys.modules["pipeline"] = sys.modules["flows"] = None
try:
    import pipeline  # noqa
    raise SystemExit("tamis is importable here")
except ImportError:
    pass
script, sys.argv = sys.argv[1], sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as exc:
    if exc.code not in (0, None):
        raise
finally:
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("pipeline", "flows") and sys.modules[m] is not None)
    print(json.dumps({{"tamis_loaded": loaded}}))
"""


def run_isolated(script: Path, *args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python -I` on `script`, from a folder outside the repository, PYTHONPATH empty: what a user without tamis has."""
    proc = subprocess.run([sys.executable, "-I", "-c", LAUNCH, str(script), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=600,
                          env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"tamis_loaded": []}
    return proc


@pytest.fixture(scope="module")
def letters_project(tmp_path_factory, tiny_models, prefect_harness):
    """(root, config path) after two rounds of the tiny 4-bit model (LoRA everywhere: model.train all) on the digits
    relabelled A..J."""
    from flows.round import labeling_round

    root = tmp_path_factory.mktemp("letters")
    # LoRA in the vision tower and projector too: what --format vllm has to leave out.
    config = write_project(root, tiny_models, data={"answers": list(LETTERS),
                                                    "question": "Which letter is shown in the image?"},
                           model={"train": "all"})
    for name in ("manifest.jsonl", "ground_truth.jsonl"):
        f = root / "digits" / name
        rows = [json.loads(x) for x in f.read_text().splitlines()]
        f.write_text("".join(json.dumps({**r, "answer": LETTERS[int(r["answer"])]} if "answer" in r else r) + "\n"
                             for r in rows))
    labeling_round(str(config))
    assert labeling_round(str(config), simulate=False)["adapter"]
    return root, config


@pytest.fixture(scope="module")
def exported(letters_project, tmp_path_factory):
    root, config = letters_project
    out = tmp_path_factory.mktemp("export") / "export"
    res = tamis_cli("export-model", "-c", config, "--out", out, "--merge")
    assert res.returncode == 0, said(res)
    return out


def photos(folder: Path, *, square: int | None = None) -> list[str]:
    """Eight crops of scikit-image photos: colour and grey, PNG and JPEG."""
    return photo_folder(folder, square=square, photos=("astronaut", "coffee", "chelsea", "rocket", "camera", "coins",
                                                       "moon", "page"))


def tamis_predict(config: Path, folder: Path, out: Path) -> dict[str, dict[str, str]]:
    res = tamis_cli("predict", folder, "-c", config, "--out", out)
    assert res.returncode == 0, said(res)
    return {r["file"]: r for r in read_csv(out)}


def test_letters_share_their_first_token_so_scoring_one_token_cannot_tell_them_apart(letters_project):
    from pipeline.export_model import load_processor

    _, config = letters_project
    cfg = load_config(config)
    loaded = load_processor(cfg.model)
    ids = [loaded.family.answer_token_ids(loaded.processor, cfg.data.question, a) for a in LETTERS]
    assert len({t[0] for t in ids}) == 1 and all(len(t) == 2 for t in ids)


def test_the_exports_predict_py_answers_like_tamis_predict_without_tamis(letters_project, exported, tmp_path):
    root, config = letters_project
    folder = tmp_path / "photos"
    names = photos(folder)
    (folder / "notes.png").write_bytes(b"not an image")
    tamis = tamis_predict(config, folder, tmp_path / "tamis.csv")
    cfg = json.loads((exported / "predict_config.json").read_text())
    assert cfg["answers"] == list(LETTERS) and cfg["image"] == {"size": 32, "pad": "square", "pad_color": [0, 0, 0],
                                                                "background": [255, 255, 255]}
    away = tmp_path / "elsewhere"
    away.mkdir()
    for which in ("merged", "adapter"):
        out = tmp_path / f"{which}.csv"
        run_isolated(exported / "predict.py", folder, "--out", out, "--model", which, "--base", root / "model",
                     cwd=away)
        rows = {Path(r["file"]).name: r for r in read_csv(out)}
        assert sorted(rows) == sorted([*names, "notes.png"])
        assert rows["notes.png"]["error"] and not rows["notes.png"]["answer"]
        same = sum(rows[n]["answer"] == tamis[n]["answer"] for n in names)
        assert same / len(names) >= 0.99, (which, {n: (rows[n]["answer"], tamis[n]["answer"]) for n in names})
        for n in names:
            assert float(rows[n]["probability"]) == pytest.approx(float(tamis[n]["probability"]), abs=0.03), (which, n)
            assert sum(float(rows[n][f"p:{a}"]) for a in LETTERS) == pytest.approx(1, abs=1e-5)
        # Not the uniform 1/10 that scoring only the shared first token gives.
        assert max(float(rows[n]["probability"]) for n in names) > 0.1 + 0.01


def doc_snippet(heading: str) -> str:
    """The first python block under `heading` in docs/use-your-model.md."""
    doc = (Path(__file__).parents[1] / "docs" / "use-your-model.md").read_text(encoding="utf-8")
    after = doc.split(f"\n{heading}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def test_the_docs_transformers_snippet_answers_like_tamis_predict(letters_project, exported, tmp_path):
    _, config = letters_project
    folder = tmp_path / "squares"
    names = photos(folder, square=32)  # already at the prepared size, as the snippet says
    tamis = tamis_predict(config, folder, tmp_path / "tamis.csv")
    work = tmp_path / "user"
    work.mkdir()
    (work / "export").symlink_to(exported)
    script = work / "snippet.py"
    script.write_text(doc_snippet("### Load it in transformers"))
    for n in names[:2]:  # a fresh interpreter loads transformers each time: two images show it
        (work / "photo.png").write_bytes((folder / n).read_bytes())
        said_ = run_isolated(script, cwd=work).stdout.strip().splitlines()[-2].split()
        assert said_[0] == tamis[n]["answer"], n
        assert float(said_[1]) == pytest.approx(float(tamis[n]["probability"]), abs=0.03), n


def test_format_vllm_leaves_vision_lora_out_measures_the_change_and_writes_serve_sh(letters_project, tmp_path):
    from safetensors.torch import load_file

    from pipeline.evaluate import predict_answers
    from pipeline.model.loading import load_model
    from pipeline.round_state import trained_round
    from pipeline.serving.vllm import test_rows

    root, config = letters_project
    cfg = load_config(config)
    out = tmp_path / "vllm-export"
    res = tamis_cli("export-model", "-c", config, "--out", out, "--format", "vllm")
    assert res.returncode == 0, said(res)
    full = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    lang = load_file(str(out / "adapter-vllm" / "adapter_model.safetensors"))
    assert lang and all(".text_model." in k for k in lang) and any(".vision_model." in k for k in full)
    dropped = len(full) - len(lang)
    assert sorted(lang) == sorted(k for k in full if ".text_model." in k)

    # The measured change is the share of the round's test answers that differ between the two adapters.
    rows = test_rows(cfg.artifacts, trained_round(cfg.artifacts, None))
    got = [predict_answers(load_model(cfg.model, adapter=out / a), rows, cfg.data.answers)
           for a in ("adapter", "adapter-vllm")]
    changed = sum(x != y for x, y in zip(*got, strict=True)) / len(rows)
    assert (f"warning: vLLM takes LoRA on the language model only: {dropped} LoRA tensors on the projector / vision "
            f"tower were left out of adapter-vllm/ ({changed:.1%} of {len(rows)} test answers changed") in said(res)

    serve = (out / "serve.sh").read_text()
    assert f'BASE="${{BASE:-{root / "model"}}}"' in serve
    assert ('exec vllm serve "$BASE" --enable-lora --lora-modules tamis-round-1=./adapter-vllm --max-lora-rank 8 '
            '"$@"') in serve
    assert (out / "serve.sh").stat().st_mode & 0o100

    # A plain export over it (--force) leaves no stale vLLM files behind.
    assert tamis_cli("export-model", "-c", config, "--out", out, "--force").returncode == 0
    assert not (out / "serve.sh").exists() and not (out / "adapter-vllm").exists()
