"""Tests for tools/make_oracle.py: determinism, HF loadability, MTP tensors, reference sanity."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the oracle tool needs torch (test dependency)")
transformers = pytest.importorskip(
    "transformers", reason="the oracle tool needs transformers (test dependency)"
)
safetensors_torch = pytest.importorskip("safetensors.torch")

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "make_oracle.py"
sys.path.insert(0, str(ROOT / "tools"))
import make_oracle  # noqa: E402

NAMES = make_oracle.MODEL_NAMES
MLA_NAMES = make_oracle.MLA_NAMES  # the ones with an MTP head
ATOL = 1e-5
RTOL = 1e-5


def _tool_files(d: Path) -> dict[str, bytes]:
    """Every file the tool writes under ``d`` (relative path -> bytes), cache markers excluded."""
    return {
        p.relative_to(d).as_posix(): p.read_bytes()
        for p in sorted(d.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


def _load(oracle_dir: Path, name: str) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        oracle_dir / name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _mtp_state(oracle_dir: Path, name: str, n_layers: int) -> dict[str, Any]:
    """MTP tensors from the checkpoint, renamed to module names (experts restacked)."""
    tensors = safetensors_torch.load_file(str(oracle_dir / name / "model.safetensors"))
    prefix = f"model.layers.{n_layers}."
    state: dict[str, Any] = {}
    experts: dict[str, dict[int, Any]] = {"gate_proj": {}, "up_proj": {}, "down_proj": {}}
    for key, val in tensors.items():
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix) :]
        m = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", rest)
        if m:
            experts[m.group(2)][int(m.group(1))] = val.float()
        else:
            state[rest] = val.float()
    n = len(experts["gate_proj"])
    gate_up = [torch.cat([experts["gate_proj"][e], experts["up_proj"][e]], 0) for e in range(n)]
    state["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    state["mlp.experts.down_proj"] = torch.stack([experts["down_proj"][e] for e in range(n)])
    return state


def test_rerun_is_byte_identical(oracle_dir: Path, tmp_path: Path) -> None:
    """The session's oracle holds every model; a second run (of one model per kind of stack,
    to keep CI short: the code paths are shared) gives the same bytes."""
    out = tmp_path / "again"
    rerun = ("deepseek_v3", "mixtral")
    subprocess.run(
        [sys.executable, str(TOOL), "--out", str(out), "--only", *rerun], check=True, cwd=ROOT
    )
    first, second = _tool_files(oracle_dir), _tool_files(out)
    files = (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    )

    def expected(names: tuple[str, ...]) -> set[str]:
        return {f"{n}{s}" for n in names for s in (".ref.npz", ".ref.json")} | {
            f"{n}/{f}" for n in names for f in files
        }

    assert set(first) == expected(NAMES)
    assert set(second) == expected(rerun)
    for rel in second:
        assert first[rel] == second[rel], f"{rel} differs between two runs with the same seed"


def test_only_and_seed_options(tmp_path: Path) -> None:
    args = ["--out", str(tmp_path), "--only", "deepseek_v3", "--seed", "1"]
    subprocess.run([sys.executable, str(TOOL), *args], check=True, cwd=ROOT)
    assert (tmp_path / "deepseek_v3" / "model.safetensors").is_file()
    assert not (tmp_path / "glm_moe_dsa").exists()
    summary = json.loads((tmp_path / "deepseek_v3.ref.json").read_text())
    assert summary["seed"] == 1


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_reproduces_reference(oracle_dir: Path, name: str) -> None:
    model = _load(oracle_dir, name)
    ref = np.load(oracle_dir / f"{name}.ref.npz")
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    for i in range(len(make_oracle.PROMPT_SOURCES)):
        ids = ref[f"prompt_{i}"]
        assert ids.dtype == np.int64 and ids.ndim == 1
        with torch.no_grad():
            out = model.model(input_ids=torch.from_numpy(ids)[None], use_cache=False)
            h = out.last_hidden_state
            logits = model.lm_head(h)[0].numpy()
        assert ref[f"logits_{i}"].shape == (len(ids), vocab)
        assert ref[f"hidden_{i}"].shape == (len(ids), hidden)
        np.testing.assert_allclose(logits, ref[f"logits_{i}"], atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(h[0].numpy(), ref[f"hidden_{i}"], atol=ATOL, rtol=RTOL)
        greedy, margin = ref[f"greedy_{i}"], ref[f"greedy_margin_{i}"]
        assert greedy.shape == (make_oracle.GREEDY_STEPS,) and greedy.dtype == np.int64
        assert margin.shape == greedy.shape and margin.dtype == np.float32
        assert (margin >= 0).all()
        assert greedy[0] == int(np.argmax(ref[f"logits_{i}"][-1]))
        assert np.isfinite(ref[f"logits_{i}"]).all()
        if name in MLA_NAMES:
            assert ref[f"mtp_logits_{i}"].shape == (len(ids) - 1, vocab)
            assert np.isfinite(ref[f"mtp_logits_{i}"]).all()
        else:
            assert f"mtp_logits_{i}" not in ref
    # logits are not flat
    assert float(ref["logits_3"].std(axis=-1).min()) > 0.5


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_cached_generate(oracle_dir: Path, name: str) -> None:
    """No-cache greedy reference == transformers' KV-cached generate (margins permitting)."""
    model = _load(oracle_dir, name)
    ref = np.load(oracle_dir / f"{name}.ref.npz")
    ids = torch.from_numpy(ref["prompt_1"])[None]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    got = out[0, ids.shape[1] :].numpy()
    want, margin = ref["greedy_1"][:8], ref["greedy_margin_1"][:8]
    for t in range(8):
        if got[t] != want[t]:
            assert margin[t] < 1e-3, f"step {t}: {got[t]} != {want[t]} at margin {margin[t]}"
            break


@pytest.mark.parametrize("name", MLA_NAMES)
def test_mtp_tensors_and_reference(oracle_dir: Path, name: str) -> None:
    cfg = json.loads((oracle_dir / name / "config.json").read_text())
    n, h, v = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    e, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    assert cfg["num_nextn_predict_layers"] == 1
    assert cfg["scoring_func"] == "sigmoid"
    from safetensors import safe_open

    with safe_open(str(oracle_dir / name / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    p = f"model.layers.{n}."
    want = {
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "eh_proj.weight": (h, 2 * h),
        "shared_head.norm.weight": (h,),
        "shared_head.head.weight": (v, h),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_a_proj.weight": (cfg["q_lora_rank"], h),
        "self_attn.kv_a_proj_with_mqa.weight": (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], h),
        "self_attn.o_proj.weight": (h, cfg["num_attention_heads"] * cfg["v_head_dim"]),
        "mlp.gate.weight": (e, h),
        "mlp.gate.e_score_correction_bias": (e,),
        "mlp.shared_experts.gate_proj.weight": (inter, h),
        "mlp.shared_experts.down_proj.weight": (h, inter),
    }
    for j in range(e):
        want[f"mlp.experts.{j}.gate_proj.weight"] = (inter, h)
        want[f"mlp.experts.{j}.up_proj.weight"] = (inter, h)
        want[f"mlp.experts.{j}.down_proj.weight"] = (h, inter)
    if name in make_oracle.DSA_NAMES:
        nh, hd = cfg["index_n_heads"], cfg["index_head_dim"]
        want["self_attn.indexer.wq_b.weight"] = (nh * hd, cfg["q_lora_rank"])
        want["self_attn.indexer.wk.weight"] = (hd, h)
        want["self_attn.indexer.k_norm.weight"] = (hd,)
        want["self_attn.indexer.k_norm.bias"] = (hd,)
        want["self_attn.indexer.weights_proj.weight"] = (nh, h)
    for key, shape in want.items():
        assert shapes.get(p + key) == shape, (p + key, shapes.get(p + key))
    assert not any(k.startswith(p + "embed_tokens") for k in shapes)
    assert not any(k.startswith(f"model.layers.{n + 1}.") for k in shapes)
    for key, dt in dtypes.items():
        assert dt == ("F32" if key.endswith("e_score_correction_bias") else "BF16"), (key, dt)

    # The stored MTP tensors reproduce mtp_logits through the documented definition.
    model = _load(oracle_dir, name)
    mtp = make_oracle.make_mtp_layer(name, model.config).eval()
    mtp.load_state_dict(_mtp_state(oracle_dir, name, n), strict=True)
    ref = np.load(oracle_dir / f"{name}.ref.npz")
    for i in range(len(make_oracle.PROMPT_SOURCES)):
        ids = ref[f"prompt_{i}"].tolist()
        hidden = torch.from_numpy(ref[f"hidden_{i}"])
        got = make_oracle.mtp_forward(model, mtp, ids, hidden).numpy()
        np.testing.assert_allclose(got, ref[f"mtp_logits_{i}"], atol=ATOL, rtol=RTOL)


def test_glm_dsa_is_exercised(oracle_dir: Path) -> None:
    cfg = json.loads((oracle_dir / "glm_moe_dsa" / "config.json").read_text())
    ref = np.load(oracle_dir / "glm_moe_dsa.ref.npz")
    k = cfg["index_topk"]
    lengths = [len(ref[f"prompt_{i}"]) for i in range(len(make_oracle.PROMPT_SOURCES))]
    assert min(lengths) <= k < max(lengths)
    assert set(cfg["indexer_types"]) == {"full", "shared"} and cfg["indexer_types"][0] == "full"
    assert cfg["mlp_layer_types"][: cfg["first_k_dense_replace"]] == ["dense"]
    full = [i for i, t in enumerate(cfg["indexer_types"]) if t == "full"]
    for i, t in enumerate(lengths):
        keys = [f"layer_{L}" for L in full] + (["mtp"] if t - 1 > k else [])
        for key in keys:
            if t <= k:
                assert f"dsa_scores_{i}_{key}" not in ref
                continue
            scores, sel = ref[f"dsa_scores_{i}_{key}"], ref[f"dsa_topk_{i}_{key}"]
            n = scores.shape[0]
            assert sel.shape == (n, k)
            assert np.isneginf(scores[np.triu_indices(n, 1)]).all()  # causal
            for s in range(n):
                row = scores[s, : s + 1]
                assert np.isfinite(row).all()
                if s + 1 <= k:
                    assert sel[s].tolist() == list(range(s + 1)) + [-1] * (k - s - 1)
                else:
                    top = np.argsort(-row, kind="stable")
                    assert row[top[k - 1]] > row[top[k]]  # no tie at the cut
                    assert sel[s].tolist() == sorted(top[:k].tolist())


def test_deepseek_config_and_rope(oracle_dir: Path) -> None:
    cfg = json.loads((oracle_dir / "deepseek_v3" / "config.json").read_text())
    rope = cfg["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["factor"] > 1
    assert rope["original_max_position_embeddings"] < cfg["max_position_embeddings"]
    assert rope["mscale_all_dim"] > 0
    assert cfg["n_group"] == 4 and cfg["topk_group"] == 2
    assert cfg["first_k_dense_replace"] == 1
    model = _load(oracle_dir, "deepseek_v3")
    base = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    assert model.model.layers[0].self_attn.scaling > base**-0.5  # YaRN mscale enters the softmax


def test_tokenizer_files(oracle_dir: Path) -> None:
    from transformers import AutoTokenizer

    for name in NAMES:
        d = oracle_dir / name
        tok = AutoTokenizer.from_pretrained(d)
        ids = {t: tok.convert_tokens_to_ids(t) for t in make_oracle.SPECIAL_TOKENS}
        assert len(tok) == json.loads((d / "config.json").read_text())["vocab_size"]
        gen = json.loads((d / "generation_config.json").read_text())
        cfg = json.loads((d / "config.json").read_text())
        assert gen["eos_token_id"] == [ids["<|endoftext|>"], ids["<|user|>"]]
        assert cfg["eos_token_id"] == gen["eos_token_id"]
        text = tok.apply_chat_template(
            [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert text == "<|system|>\nS<|user|>\nHi<|assistant|>\n"
        ref = np.load(oracle_dir / f"{name}.ref.npz")
        summary = json.loads((oracle_dir / f"{name}.ref.json").read_text())
        for i, p in enumerate(summary["prompts"]):
            assert p["ids"] == ref[f"prompt_{i}"].tolist()
            assert tok(p["source_text"])["input_ids"][: p["length"]] == p["ids"]
        assert [p["length"] for p in summary["prompts"]] == [5, 12, 30, 48]
