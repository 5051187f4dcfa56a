"""The grouped-query families against the transformers oracle (OLMoE, Qwen3-MoE, Mixtral, GLM-4.5,
MiniMax-M2): HF checkpoint -> convert -> Container -> model.

f32 containers reproduce the oracle's fp32 reference (logits and final hidden within 1e-3, the
argmax of every position, the 32-token greedy continuation both teacher-forced and generated
with the KV cache). The default int4 container is held to transformers run on its dequantized
weights, the same way. A multi-token step equals one-token decode steps bit for bit; a K/V cache
saved to ``.coli_kv`` and loaded back continues bit-identically; streaming the experts under a
small RAM budget changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _oracle import container_maker, oracle_tool, reference

from runtime.models import GQAMoEModel, load_model
from storage.errors import KVFileError

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from storage.container import Container  # noqa: E402
from storage.kvfile import read_kv, write_kv  # noqa: E402

NAMES = ("olmoe", "qwen3_moe", "mixtral", "glm4_moe", "minimax_m2")
LOGIT_TOL = 1e-3  # vs the reference
DECODE_TOL = 1e-4  # cached decode vs full forward of our own model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def containers(
    oracle_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], Container]:
    """``get(name, "f32" | "q")`` -> the converted container (converted once per module)."""
    return container_maker(oracle_dir, tmp_path_factory.mktemp("gqa-containers"))


@pytest.fixture(scope="module")
def models(containers: Callable[[str, str], Container]) -> Callable[..., GQAMoEModel]:
    made: dict[tuple[str, str], GQAMoEModel] = {}

    def get(name: str, kind: str = "f32") -> GQAMoEModel:
        if (name, kind) not in made:
            m = load_model(containers(name, kind))
            assert isinstance(m, GQAMoEModel)
            made[(name, kind)] = m
        return made[(name, kind)]

    return get


def _ref(oracle_dir: Path, name: str) -> dict[str, np.ndarray]:
    return reference(oracle_dir, name)


def _oracle_tool() -> Any:
    return oracle_tool()


def _cached_greedy(m: GQAMoEModel, prompt: np.ndarray, steps: int) -> list[int]:
    cache = m.new_cache()
    toks = [int(m.forward(prompt, cache).logits[-1].argmax())]
    for _ in range(steps - 1):
        toks.append(int(m.forward(np.array([toks[-1]]), cache).logits[0].argmax()))
    assert cache.length == len(prompt) + steps - 1
    return toks


def _teacher_forced(m: GQAMoEModel, prompt: np.ndarray, cont: np.ndarray) -> np.ndarray:
    """Prefill then one-token decode over ``cont``: logits [len(prompt) + len(cont), V]."""
    cache = m.new_cache()
    rows = [m.forward(prompt, cache).logits]
    rows += [m.forward(np.array([t]), cache).logits for t in cont]
    return np.concatenate(rows)


@pytest.mark.parametrize("name", NAMES)
def test_f32_matches_oracle(name: str, oracle_dir: Path, models: Any) -> None:
    m, ref = models(name), _ref(oracle_dir, name)
    worst = 0.0
    for i in range(4):
        prompt, want = ref[f"prompt_{i}"], ref[f"greedy_{i}"]
        out = m.forward(prompt, m.new_cache())
        diff = float(np.abs(out.logits - ref[f"logits_{i}"]).max())
        assert diff <= LOGIT_TOL, (i, diff)
        assert np.abs(out.hidden - ref[f"hidden_{i}"]).max() <= LOGIT_TOL
        np.testing.assert_array_equal(out.logits.argmax(1), ref[f"logits_{i}"].argmax(1))
        worst = max(worst, diff)
        # teacher-forced through the cache: same logits as one full forward, same argmax
        seq = np.concatenate([prompt, want[:-1]])
        forced = _teacher_forced(m, prompt, want[:-1])
        full = m.forward(seq, m.new_cache()).logits
        assert np.abs(forced - full).max() <= DECODE_TOL, i
        np.testing.assert_array_equal(forced[len(prompt) - 1 :].argmax(1), want)
        assert _cached_greedy(m, prompt, len(want)) == want.tolist(), i
    print(f"{name}: f32 max |logit diff| {worst:.2e}")


def _dequantized_reference(name: str, oracle_dir: Path, c: Container) -> Any:
    """The transformers model with every parameter set to the container's dequantized one."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(oracle_dir / name)
    config._attn_implementation = "eager"
    model = _oracle_tool()._model_classes(name)["causal_lm"](config).eval()
    fam = c.arch.family
    n_exp = c.arch.n_routed_experts

    def on_disk(hf_name: str) -> str:  # transformers' module names -> the checkpoint's
        if fam.moe_prefix != "mlp" and (".mlp.gate." in hf_name or "e_score" in hf_name):
            return hf_name.replace(".mlp.", f".{fam.moe_prefix}.")
        return hf_name

    with torch.no_grad():
        for pname, p in (dict(model.named_parameters()) | dict(model.named_buffers())).items():
            if pname.endswith("inv_freq"):
                continue
            layer = pname.split("mlp.experts.")[0]  # "model.layers.L."
            if pname.endswith("mlp.experts.gate_up_proj"):
                val = np.stack([
                    np.concatenate([c.load_f32(layer + fam.expert_tensor(e, "gate_proj")),
                                    c.load_f32(layer + fam.expert_tensor(e, "up_proj"))])
                    for e in range(n_exp)
                ])  # fmt: skip
            elif pname.endswith("mlp.experts.down_proj"):
                val = np.stack(
                    [c.load_f32(layer + fam.expert_tensor(e, "down_proj")) for e in range(n_exp)]
                )
            else:
                val = c.load_f32(on_disk(pname))
            p.copy_(torch.from_numpy(np.asarray(val, np.float32).reshape(p.shape)))
    return model


@pytest.mark.parametrize("name", NAMES)
def test_int4_matches_dequantized_reference(
    name: str, oracle_dir: Path, containers: Any, models: Any
) -> None:
    c, m = containers(name, "q"), models(name, "q")
    hf = _dequantized_reference(name, oracle_dir, c)
    tool = _oracle_tool()
    ref = _ref(oracle_dir, name)
    worst = 0.0
    for i in (0, 2, 3):
        prompt = ref[f"prompt_{i}"]
        want, want_hidden = tool.forward_full(hf, prompt.tolist())
        out = m.forward(prompt, m.new_cache())
        diff = float(np.abs(out.logits - want.numpy()).max())
        assert diff <= LOGIT_TOL, (i, diff)
        assert np.abs(out.hidden - want_hidden.numpy()).max() <= LOGIT_TOL
        worst = max(worst, diff)
        hf_greedy, _ = tool.greedy(hf, prompt.tolist(), 12)
        assert _cached_greedy(m, prompt, 12) == hf_greedy, i
    print(f"{name}: int4 vs dequantized reference max |logit diff| {worst:.2e}")


@pytest.mark.parametrize("name", ["qwen3_moe", "glm4_moe"])
def test_multi_token_step_is_bit_identical_to_decode(
    name: str, oracle_dir: Path, models: Any
) -> None:
    """A verify-like step of k tokens equals k one-token steps bit for bit (int4 kernels are
    batch-invariant; attention is row by row)."""
    m, ref = models(name, "q"), _ref(oracle_dir, name)
    prompt, nxt = ref["prompt_1"], ref["greedy_1"][:6]
    a, b = m.new_cache(), m.new_cache()
    m.forward(prompt, a)
    m.forward(prompt, b)
    many = m.forward(nxt, a).logits
    ones = np.concatenate([m.forward(nxt[i : i + 1], b).logits for i in range(len(nxt))])
    np.testing.assert_array_equal(many, ones)
    np.testing.assert_array_equal(a.keys(0, a.length), b.keys(0, b.length))


def test_kv_file_round_trip_continues_bit_identically(
    oracle_dir: Path, models: Any, tmp_path: Path
) -> None:
    m, ref = models("mixtral", "q"), _ref(oracle_dir, "mixtral")
    prompt, cont = ref["prompt_2"], ref["greedy_2"][:5]
    cache = m.new_cache()
    m.forward(prompt, cache)
    path = tmp_path / ".coli_kv"
    write_kv(path, cache, m.config.vocab_size, identity=7)
    assert path.read_bytes()[:8] == b"COLIKV2\0"
    loaded = read_kv(path, m.new_cache, m.config.vocab_size, identity=7)
    assert loaded.layout == "gqa" and loaded.length == len(prompt)
    a = np.concatenate([m.forward(np.array([t]), cache).logits for t in cont])
    b = np.concatenate([m.forward(np.array([t]), loaded).logits for t in cont])
    np.testing.assert_array_equal(a, b)


def test_kv_file_of_the_other_family_is_refused(
    oracle_dir: Path, models: Any, containers: Any, tmp_path: Path
) -> None:
    gqa = models("olmoe", "q")
    mla = load_model(containers("deepseek_v3", "f32"))
    cache = mla.new_cache()
    mla.forward(_ref(oracle_dir, "deepseek_v3")["prompt_0"], cache)
    path = tmp_path / ".coli_kv"
    write_kv(path, cache, mla.config.vocab_size)
    assert path.read_bytes()[:8] == b"COLIKV1\0"
    with pytest.raises(KVFileError, match="compressed MLA cache but this model keeps a grouped"):
        read_kv(path, gqa.new_cache, gqa.config.vocab_size)


@pytest.fixture(scope="module")
def streamed_reference(containers: Any) -> dict[str, Any]:
    import colibri

    path = containers("qwen3_moe", "q").path
    with colibri.open_model(path, learn=False) as m:
        assert m.stats()["experts"]["mode"] == "resident"
        return {
            "path": path,
            "tokens": m.generate([5, 17, 99, 300, 12, 44], max_new_tokens=16),
            "logits": m.forward([5, 17, 99, 300, 12, 44]),
        }


@pytest.mark.parametrize(
    ("lru", "prefetch", "reader"),
    [(lru, p, "threads") for lru in (0, 2) for p in ("auto", "on", "off")]
    + [(0, "on", "uring"), (2, "auto", "buffered")],
)
def test_streaming_does_not_change_output(
    streamed_reference: dict[str, Any],
    lru: int,
    prefetch: str,
    reader: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Qwen3-MoE (a dense layer between MoE ones) streamed under a small RAM budget: greedy
    tokens and logits bit-identical to everything resident, for budgets x readers x prefetch."""
    from _demo import budget_for_lru

    import colibri

    monkeypatch.setenv("HOME", str(tmp_path))  # its own .coli_usage
    path = streamed_reference["path"]
    budget = budget_for_lru(path, lru)
    with colibri.open_model(path, ram_budget=budget, prefetch=prefetch, reader=reader) as m:
        toks = m.generate([5, 17, 99, 300, 12, 44], max_new_tokens=16)
        logits = m.forward([5, 17, 99, 300, 12, 44])
        st = m.stats()["experts"]
    assert st["mode"] == "streaming" and st["lru_slots_per_layer"] == lru
    assert st["bytes_read"] > 0
    assert toks == streamed_reference["tokens"]
    assert np.array_equal(logits, streamed_reference["logits"])


def test_fast_int8_rows_in_blocks_match_one_call_grouped_query(
    containers: Callable[[str, str], Container],
) -> None:
    """The grouped-query attention's row blocks on the pool (a long chunk, 2+ threads) used
    the exact kernels where one block used fast-int8: logits changed with the thread count."""
    from runtime.compute import ExpertCompute
    from runtime.context import StepContext

    model = load_model(containers("olmoe", "q"))
    ids = (np.arange(48, dtype=np.int64) * 7) % 90 + 3

    def run(threads: int) -> np.ndarray:
        comp = ExpertCompute(threads, parallel_min_macs=0 if threads > 1 else 1 << 24,
                             kernels="fast-int8")  # fmt: skip
        try:
            out = model.forward(ids, model.new_cache(), ctx=StepContext(comp))
            return np.asarray(out.logits)
        finally:
            comp.close()

    assert np.array_equal(run(2), run(1))
