"""Every grouped-query family end to end through the real `coli` command: convert the oracle's
HF checkpoint, `coli doctor` passes, `coli run` generates (greedy tokens equal to the model
opened in-process); an unsupported model_type fails at convert and doctor with the list."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from _cli import coli
from tokenizers import Tokenizer

import colibri

pytest.importorskip("torch", reason="the oracle checkpoints need torch (test dependency)")

FAMILIES = ("deepseek_v32", "olmoe", "qwen3_moe", "mixtral", "glm4_moe", "minimax_m2")
SUPPORTED = (
    "glm_moe_dsa, deepseek_v3, kimi_k2, deepseek_v32, olmoe, qwen3_moe, mixtral, glm4_moe, "
    "minimax_m2"
)


@pytest.mark.parametrize("name", FAMILIES)
def test_convert_doctor_run(name: str, oracle_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    r = coli("-v", "convert", str(oracle_dir / name), str(out), home=tmp_path)
    assert r.returncode == 0, r.stderr
    # not a terminal: the progress is one structured log line per output shard
    assert "progress" in r.stderr and "out-00000.safetensors" in r.stderr, r.stderr
    r = coli("doctor", "--model", str(out), home=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL" not in r.stdout and f"PASS config     {name}" in r.stdout
    r = coli("info", "--model", str(out), "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["model_type"] == name and info["routed_experts_per_layer"] > 0
    r = coli("plan", "--model", str(out), "--ram", "8MiB", "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    cfg = json.loads((out / "config.json").read_text())
    if name != "deepseek_v32":  # grouped-query: K and V of every KV head, float32
        heads = cfg["num_key_value_heads"]
        hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        assert plan["kv_bytes_per_token"] == 4 * cfg["num_hidden_layers"] * 2 * heads * hd
    r = coli("run", "--model", str(out), "--raw", "-n", "8", "The quick brown fox", home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "8 tokens" in r.stderr
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    with colibri.open_model(out, learn=False) as m:
        want = m.generate(tok.encode("The quick brown fox").ids, max_new_tokens=8)
    assert r.stdout.rstrip("\n") == tok.decode(want)


def test_unsupported_model_type_names_the_supported_list(oracle_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(oracle_dir / "mixtral", src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(cfg))
    r = coli("convert", str(src), str(tmp_path / "out"), home=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert f"model_type 'llama' is not supported (supported: {SUPPORTED})" in r.stderr
    good = tmp_path / "good"
    assert coli("convert", str(oracle_dir / "mixtral"), str(good), home=tmp_path).returncode == 0
    (good / "config.json").write_text(json.dumps(cfg))
    r = coli("doctor", "--model", str(good), home=tmp_path)
    assert r.returncode != 0
    assert "FAIL config" in r.stdout and f"(supported: {SUPPORTED})" in r.stdout


def test_server_kv_slot_prefix_reuse_and_brain_on_a_gqa_model(
    oracle_dir: Path, tmp_path: Path
) -> None:
    """GLM-4.5 served: a kept slot reuses the conversation (K/V cache), is persisted as a
    version-2 ``.coli_kv``, survives kill -9, and reuse is exact; ``/experts`` (the dashboard's
    Brain) is that model's MoE layers x experts."""
    from _serve import Server

    model = tmp_path / "model"
    assert coli("convert", str(oracle_dir / "glm4_moe"), str(model), home=tmp_path).returncode == 0
    kv = tmp_path / "kv"
    args = ("--kv-slots", "1", "--kv-dir", str(kv))
    turns = ["The quick brown fox", "jumps over the lazy dog", "and then"]

    def ask(srv: Server, upto: int, slot: int | None) -> tuple[str, dict[str, int]]:
        msgs = [{"role": "user", "content": " ".join(turns[: upto + 1])}]
        body: dict[str, object] = {"model": "model", "messages": msgs, "max_tokens": 6}
        body |= {"temperature": 0, "ignore_eos": True}
        if slot is not None:
            body["cache_slot"] = slot
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()
        assert "choices" in r, r
        return r["choices"][0]["message"]["content"], r["colibri"]

    first = Server(tmp_path, *args, model=model).wait_ready()
    try:
        ask(first, 0, 0)
        text1, st1 = ask(first, 1, 0)
        brain = httpx.get(first.url + "/experts", timeout=10).json()
    finally:
        first.kill9()
    assert st1["prompt_tokens_reused"] > 0
    assert len(brain["codes"]) == 2 and all(
        len(row) == 8 for row in brain["codes"]
    )  # 3 layers, 1 dense
    assert (kv / ".coli_kv.0").read_bytes()[:8] == b"COLIKV2\0"
    again = Server(tmp_path, *args, model=model).wait_ready()
    try:
        text2, st2 = ask(again, 2, 0)
        fresh, _ = ask(again, 2, None)
    finally:
        again.stop()
    assert st2["prompt_tokens_reused"] > st1["prompt_tokens_reused"]
    assert text2 == fresh and text1


def test_kimi_k25_text_model_is_unwrapped(oracle_dir: Path, tmp_path: Path) -> None:
    """A Kimi K2.5-shaped checkpoint (``model_type: kimi_k25``, the DeepSeek-V3-layout text model
    under ``language_model.`` and its config in ``text_config``, beside a vision tower) converts
    to a ``kimi_k2`` container whose logits are the DeepSeek-V3 oracle's."""
    import numpy as np
    from safetensors.torch import load_file, save_file

    from runtime.models import load_model
    from storage.container import Container

    src = tmp_path / "k25"
    shutil.copytree(oracle_dir / "deepseek_v3", src)
    text = json.loads((src / "config.json").read_text())
    text["model_type"] = "kimi_k2"
    wrapper = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
               "text_config": text, "vision_config": {"hidden_size": 8}}  # fmt: skip
    (src / "config.json").write_text(json.dumps(wrapper))
    tensors = load_file(str(src / "model.safetensors"))
    wrapped = {f"language_model.{k}": v for k, v in tensors.items()}
    wrapped["vision_tower.patch_embed.weight"] = next(iter(tensors.values())).clone()
    save_file(wrapped, str(src / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "model"
    f32 = ("--experts", "f32", "--dense", "f32", "--io", "f32", "--mtp", "f32")
    r = coli("convert", str(src), str(out), *f32, home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "kimi_k25: converted its text model (kimi_k2" in r.stdout + r.stderr
    assert json.loads((out / "config.json").read_text())["model_type"] == "kimi_k2"
    assert coli("doctor", "--model", str(out), home=tmp_path).returncode == 0
    c = Container.open(out)
    assert not any(n.startswith(("vision_tower", "language_model")) for n in c.names())
    ref = np.load(oracle_dir / "deepseek_v3.ref.npz")
    m = load_model(c)
    got = m.forward(ref["prompt_2"], m.new_cache()).logits
    np.testing.assert_array_equal(got.argmax(1), ref["logits_2"].argmax(1))
    assert np.abs(got - ref["logits_2"]).max() <= 1e-3
