"""Smoke tests for tools/train_demo.py and tools/demo_corpus.py (the bundled demo model's trainer).

A tiny preset trains for a few steps on ``pydoc_data.topics``; the tests check that training,
an interrupted-then-resumed run (bit-identical to an uninterrupted one), the HF export and the
colibri conversion all work. The real demo run is documented in docs/demo_model.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the demo trainer needs torch (test dependency)")
transformers = pytest.importorskip(
    "transformers", reason="the demo trainer needs transformers (test dependency)"
)
safetensors_torch = pytest.importorskip("safetensors.torch")

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "train_demo.py"
sys.path.insert(0, str(ROOT / "tools"))
import demo_corpus  # noqa: E402

TINY = [
    "--preset",
    "tiny",
    "--docs-root",
    "none",
    "--no-chatterbot",
    "--threads",
    "1",
    "--log-every",
    "4",
    "--eval-seqs",
    "8",
    "--container-eval-seqs",
    "2",
]


def _run(out: Path, *extra: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--out", str(out), *TINY, *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def _ckpt(out: Path) -> dict[str, Any]:
    payload: dict[str, Any] = torch.load(
        out / "ckpt" / "state.pt", map_location="cpu", weights_only=False
    )
    return payload


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted tiny run with every stage (train, eval, export, convert, samples)."""
    out = tmp_path_factory.mktemp("demo-full")
    _run(out)
    return out


def test_report_has_the_metrics(full_run: Path) -> None:
    report = json.loads((full_run / "report.json").read_text())
    assert report["train"]["steps"] == 8
    assert report["train"]["tokens"] == 8 * 4 * 32
    ev = report["eval"]
    for key in ("ppl", "unigram_ppl", "mtp_top1", "mtp_agrees_with_main", "main_top1"):
        assert ev[key] == ev[key] and ev[key] >= 0  # finite, not NaN
    assert set(ev["routing"]) == {"1", "2", "mtp"}  # MoE layers 1..2 and the MTP layer
    for stats in ev["routing"].values():
        assert 0.0 < stats["entropy_norm"] <= 1.0
    assert report["container_eval"]["tokens"] > 0
    assert len(report["samples"]) >= 2
    assert (full_run / "report.md").read_text().startswith("# colibri demo model")


def test_hf_export_loads_with_transformers(full_run: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = full_run / "hf"
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["model_type"] == "glm_moe_dsa"
    assert cfg["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert cfg["num_nextn_predict_layers"] == 1
    assert cfg["scoring_func"] == "sigmoid"
    assert cfg["eos_token_id"] == [0, 2]  # <|endoftext|>, <|user|>
    gen = json.loads((hf / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [0, 2]
    tcfg = json.loads((hf / "tokenizer_config.json").read_text())
    assert "<|assistant|>" in tcfg["chat_template"]

    tensors = safetensors_torch.load_file(str(hf / "model.safetensors"))
    n = cfg["num_hidden_layers"]
    for name in (
        "eh_proj.weight",
        "enorm.weight",
        "hnorm.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
        "mlp.gate.e_score_correction_bias",
        "self_attn.indexer.wk.weight",
        "mlp.experts.0.gate_proj.weight",
    ):
        assert f"model.layers.{n}.{name}" in tensors, name
    for key, val in tensors.items():
        want = torch.float32 if key.endswith("e_score_correction_bias") else torch.bfloat16
        assert val.dtype == want, key
    # The correction bias really moved (aux-loss-free balancing ran).
    assert float(tensors["model.layers.1.mlp.gate.e_score_correction_bias"].abs().max()) > 0

    model: Any = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
    assert logits.shape == (1, 4, cfg["vocab_size"])
    assert bool(torch.isfinite(logits).all())


def test_container_opens_and_chats(full_run: Path) -> None:
    from colibri.tokenizer import ChatTokenizer
    from storage.container import Container

    dst = full_run / "container"
    c = Container.open(dst)
    assert not (dst / ".coli_usage").exists()  # the sanity run must not write into the model
    assert sorted(p.name for p in dst.glob("out-*.safetensors")) == [
        "out-00000.safetensors",
        "out-mtp-00000.safetensors",
    ]
    tok_path = c.tokenizer_path()
    assert tok_path is not None
    tok = ChatTokenizer(tok_path, c.tokenizer_config())
    ids = tok.encode_chat([{"role": "user", "content": "What is a list?"}])
    assert ids[0] == 2 and ids[-2:] == [3, tok.encode("\n")[0]]  # <|user|> ... <|assistant|>\n


def test_resume_is_bit_identical(full_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    log = _run(out, "--stop-after-steps", "3")
    assert "stopped by --stop-after-steps at step 3/8" in log
    assert _ckpt(out)["state"]["step"] == 3
    assert not (out / "hf").exists()  # an unfinished run exports nothing
    log = _run(out, "--no-export")
    assert "resumed from" in log and "at step 3/8" in log
    resumed, full = _ckpt(out), _ckpt(full_run)
    assert resumed["state"]["step"] == full["state"]["step"] == 8
    for part in ("model", "mtp"):
        assert resumed[part].keys() == full[part].keys()
        for key, val in full[part].items():
            assert torch.equal(resumed[part][key], val), (part, key)

    # Other settings on the same checkpoint are refused, not silently mixed.
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--out", str(out), *TINY, "--lr", "0.01", "--no-export"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode != 0 and "other settings" in proc.stderr


# ----------------------------------------------------------------------------- corpus


GLOSSARY = """<html><body><div class="body" role="main"><h1>Glossary</h1>
<dl class="glossary"><dt id="term-list">list<a class="headerlink" href="#">¶</a></dt>
<dd><p>A built-in Python <a href="#term-sequence">sequence</a>.</p></dd></dl></div>
<div class="sphinxsidebar">navigation</div></body></html>"""

LIBRARY = """<html><body><div class="body" role="main"><h1>os.path — paths</h1>
<p>This module implements   some useful functions.</p>
<p>Unlike a Unix shell, Python does not do any automatic path expansions. Functions such as
expanduser() can be invoked explicitly when an application desires shell-like expansion.</p>
<dl class="py function"><dt class="sig" id="os.path.join"><span>os.path.join</span>(path)</dt>
<dd><p>Join one or more path segments.</p></dd></dl>
<div class="highlight"><pre>&gt;&gt;&gt; import os
&gt;&gt;&gt; os.path.join("a", "b")</pre></div>
<ul><li><p>first</p></li><li><p>second</p></li></ul></div></body></html>"""


def test_html_to_text_keeps_prose_and_code() -> None:
    text = demo_corpus.html_to_text(LIBRARY)
    assert text.startswith("os.path — paths\n\nThis module implements some useful functions.")
    assert '>>> import os\n>>> os.path.join("a", "b")' in text
    assert "- first\n\n- second" in text
    assert "¶" not in demo_corpus.html_to_text(GLOSSARY)
    assert "navigation" not in demo_corpus.html_to_text(GLOSSARY)


def test_corpus_from_docs_tree(tmp_path: Path) -> None:
    (tmp_path / "library").mkdir()
    (tmp_path / "glossary.html").write_text(GLOSSARY + " " * 200)
    (tmp_path / "library" / "os.path.html").write_text(LIBRARY)
    corpus = demo_corpus.build_corpus(tmp_path, use_chatterbot=False, held_out_fraction=0.0)
    docs = {d.name: d for d in corpus.train}
    assert "docs:library/os.path.html" in docs
    chat = docs["glossary:list:0"]
    assert chat.chat and chat.unit == "docs:glossary.html"
    assert chat.text.endswith(
        "<|user|>\nWhat is a list in Python?<|assistant|>\nA built-in Python sequence."
    )
    api = docs["api:library/os.path.html:os.path.join:0"].text
    assert "<|user|>\nWhat does os.path.join() do?<|assistant|>\n" in api
    assert api.endswith("os.path.join(path)\n\nJoin one or more path segments.")


def test_held_out_split_is_deterministic_and_leak_free() -> None:
    a = demo_corpus.build_corpus(None, use_chatterbot=False)
    b = demo_corpus.build_corpus(None, use_chatterbot=False)
    assert [d.name for d in a.held_out] == [d.name for d in b.held_out]
    held = {d.unit for d in a.held_out}
    assert held and not held & {d.unit for d in a.train}
    s = a.stats["pydoc-topics"]
    frac = s["held_out_chars"] / (s["held_out_chars"] + s["train_chars"])
    assert 0.02 <= frac < 0.10
