"""The numpy models against the transformers oracle: HF checkpoint -> convert -> Container -> model.

f32 containers must reproduce the oracle's fp32 reference (logits, final hidden, MTP logits, DSA
selections, greedy continuations). Quantized containers (the default policy) are compared with
transformers run on the *dequantized* container weights.

DSA ties. With few index heads, relu makes keys score exactly 0.0, so the k-th boundary can be
a tie. torch.topk's pick among tied keys depends on the row length (libstdc++ nth_element), so
a KV-cached decode (row of length p + 1) and a full forward of the whole sequence (row padded
with -inf to the total length) may keep different keys -- inside transformers too. The runtime
reproduces torch's pick exactly; the tests therefore hold:

* full forwards (and the oracle's full-forward greedy) to the oracle;
* cached decode to transformers' own cached decode (computed here) token for token, and to the
  oracle's greedy too when the oracle reports DSA margins above ``TIE_EPS`` in every forward;
* cached-vs-full differences only after a DSA row whose selections differ at a boundary gap
  below ``TIE_EPS`` (the margin-aware rule).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from _oracle import container_maker, oracle_tool, reference

from runtime.context import StepContext
from runtime.layers import mla
from runtime.models import MLAMoEModel, load_model
from runtime.weights import ResidentExperts
from storage.errors import ModelError

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from storage.container import Container  # noqa: E402

NAMES = ("glm_moe_dsa", "deepseek_v3", "deepseek_v32")
DSA_NAMES = ("glm_moe_dsa", "deepseek_v32")  # with a lightning indexer (near-tie rules below)
LOGIT_TOL = 1e-3  # vs the reference
DECODE_TOL = 1e-4  # cached decode vs full forward of our own model
TIE_EPS = 1e-5  # DSA boundary gaps below this may select differently

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def containers(
    oracle_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], Container]:
    """``get(name, "f32" | "q")`` -> the converted container (converted once per module)."""
    return container_maker(oracle_dir, tmp_path_factory.mktemp("containers"))


@pytest.fixture(scope="module")
def models(containers: Callable[[str, str], Container]) -> Callable[[str, str], MLAMoEModel]:
    made: dict[tuple[str, str], MLAMoEModel] = {}

    def get(name: str, kind: str = "f32") -> MLAMoEModel:
        if (name, kind) not in made:
            made[(name, kind)] = load_model(containers(name, kind))
        return made[(name, kind)]

    return get


def _ref(oracle_dir: Path, name: str) -> dict[str, np.ndarray]:
    return reference(oracle_dir, name)


def _prompts(ref: dict[str, np.ndarray]) -> list[int]:
    return sorted(int(k.split("_")[1]) for k in ref if k.startswith("prompt_"))


def _oracle_tool() -> Any:
    return oracle_tool()


def _boundary_gap(row: np.ndarray, k: int) -> float:
    fin = np.sort(row[np.isfinite(row)])[::-1]
    return float(fin[k - 1] - fin[k]) if fin.size > k else float("inf")


class Recorder:
    """Observer collecting DSA scores/selections per (event, layer), one entry per forward."""

    def __init__(self) -> None:
        self.events: dict[tuple[str, int], list[np.ndarray]] = {}

    def __call__(self, event: str, layer: int, arr: np.ndarray) -> None:
        self.events.setdefault((event, layer), []).append(np.array(arr))


# ----------------------------------------------------------------------------- f32


@pytest.mark.parametrize("name", NAMES)
def test_f32_logits_hidden_argmax(name: str, oracle_dir: Path, models: Any) -> None:
    m, ref = models(name), _ref(oracle_dir, name)
    worst = 0.0
    for i in _prompts(ref):
        out = m.forward(ref[f"prompt_{i}"], m.new_cache())
        diff = np.abs(out.logits - ref[f"logits_{i}"]).max(axis=1)  # per position
        assert diff.max() <= LOGIT_TOL, (i, diff)
        assert np.abs(out.hidden - ref[f"hidden_{i}"]).max() <= LOGIT_TOL
        np.testing.assert_array_equal(out.logits.argmax(1), ref[f"logits_{i}"].argmax(1))
        worst = max(worst, float(diff.max()))
    print(f"{name}: f32 max |logit diff| {worst:.2e}")


@pytest.mark.parametrize("mode", ["absorbed", "reconstruct"])
@pytest.mark.parametrize("name", NAMES)
def test_f32_forced_attention_orders_agree(
    name: str, mode: str, oracle_dir: Path, models: Any
) -> None:
    m, ref = models(name), _ref(oracle_dir, name)
    i = _prompts(ref)[-1]
    auto = m.forward(ref[f"prompt_{i}"], m.new_cache(), ctx=StepContext(attention_mode="auto"))
    forced = m.forward(
        ref[f"prompt_{i}"], m.new_cache(), ctx=StepContext(attention_mode=mode)
    ).logits
    auto = auto.logits
    assert np.abs(forced - auto).max() <= DECODE_TOL
    assert np.abs(forced - ref[f"logits_{i}"]).max() <= LOGIT_TOL


@pytest.mark.parametrize("name", DSA_NAMES)
def test_f32_full_forward_greedy_matches_oracle(name: str, oracle_dir: Path, models: Any) -> None:
    """The oracle's definition: each step a full no-cache forward over the sequence so far.

    Only the DSA models: without DSA, cached decode equals the full forward (checked below)."""
    m, ref = models(name), _ref(oracle_dir, name)
    for i in _prompts(ref):
        seq = list(ref[f"prompt_{i}"])
        want = ref[f"greedy_{i}"].tolist()
        for _ in range(len(want)):
            seq.append(int(m.forward(np.array(seq), m.new_cache()).logits[-1].argmax()))
        assert seq[-len(want) :] == want, i


def _cached_greedy(m: MLAMoEModel, prompt: np.ndarray, steps: int) -> tuple[list[int], np.ndarray]:
    cache = m.new_cache()
    out = m.forward(prompt, cache)
    toks, rows = [int(out.logits[-1].argmax())], [out.logits[-1]]
    for _ in range(steps - 1):
        o = m.forward(np.array([toks[-1]]), cache)
        toks.append(int(o.logits[0].argmax()))
        rows.append(o.logits[0])
    assert cache.length == len(prompt) + steps - 1
    return toks, np.array(rows)


def _hf_cached_greedy(hf: Any, prompt: np.ndarray, steps: int) -> tuple[list[int], np.ndarray]:
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(prompt[None]), use_cache=True)
        cache = out.cache
        toks, rows = [int(out.logits[0, -1].argmax())], [out.logits[0, -1].numpy()]
        for _ in range(steps - 1):
            out = hf(input_ids=torch.tensor([[toks[-1]]]), cache=cache, use_cache=True)
            cache = out.cache
            toks.append(int(out.logits[0, -1].argmax()))
            rows.append(out.logits[0, -1].numpy())
    return toks, np.array(rows)


@pytest.mark.parametrize("name", NAMES)
def test_f32_cached_greedy(name: str, oracle_dir: Path, models: Any) -> None:
    """Prefill + token-by-token decode with the KV cache.

    deepseek_v3: identical to the oracle's greedy. DSA models: identical to transformers' own
    cached decode (tokens, and logits within LOGIT_TOL), and to the oracle's full-forward greedy
    unless the oracle reports a DSA tie (module docstring).
    """
    m, ref = models(name), _ref(oracle_dir, name)
    hf = None
    ties = False
    if name in DSA_NAMES:
        summary = json.loads((oracle_dir / f"{name}.ref.json").read_text())
        margin = summary.get("dsa_min_boundary_margin_all_forwards", 0.0)
        ties = not margin > TIE_EPS
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(
            oracle_dir / name, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    same_as_oracle = []
    for i in _prompts(ref):
        want = ref[f"greedy_{i}"].tolist()
        toks, rows = _cached_greedy(m, ref[f"prompt_{i}"], len(want))
        same_as_oracle.append(toks == want)
        if not ties:
            assert toks == want, i
        if hf is not None:
            hf_toks, hf_rows = _hf_cached_greedy(hf, ref[f"prompt_{i}"], len(want))
            assert toks == hf_toks, i
            assert np.abs(rows - hf_rows).max() <= LOGIT_TOL, i
    print(f"{name}: cached greedy == oracle full-forward greedy per prompt: {same_as_oracle}")


@pytest.mark.parametrize("name", NAMES)
def test_f32_decode_after_prefill_equals_full_forward(
    name: str, oracle_dir: Path, models: Any
) -> None:
    """Cached decode logits == full-forward logits (1e-4), up to the first DSA tie flip."""
    m, ref = models(name), _ref(oracle_dir, name)
    topk = getattr(m.config, "index_topk", None)
    worst, flips = 0.0, 0
    for i in _prompts(ref):
        prompt = ref[f"prompt_{i}"]
        seq = np.concatenate([prompt, ref[f"greedy_{i}"][:-1]])
        full_rec, dec_rec = Recorder(), Recorder()
        full = m.forward(seq, m.new_cache(), ctx=StepContext(observer=full_rec)).logits
        dec_ctx = StepContext(observer=dec_rec)
        cache = m.new_cache()
        rows = [m.forward(prompt, cache, ctx=dec_ctx).logits]
        for tok in seq[len(prompt) :]:
            rows.append(m.forward(np.array([tok]), cache, ctx=dec_ctx).logits)
        dec = np.concatenate(rows)
        limit = len(seq)  # positions compared: before the first DSA selection difference
        for (event, layer), sels in dec_rec.events.items():
            if event != "dsa_select" or topk is None:
                continue
            scores = dec_rec.events[("dsa_scores", layer)]
            full_sel = full_rec.events[("dsa_select", layer)][0]
            # one entry per decode step that ran the indexer (prompt prefill: several rows)
            for sel, sc in zip(sels, scores, strict=True):
                t, s = sel.shape
                for r in range(t):
                    pos = s - t + r
                    if pos >= limit:
                        continue
                    if not np.array_equal(sel[r, : pos + 1], full_sel[pos, : pos + 1]):
                        assert _boundary_gap(sc[r], topk) < TIE_EPS, (i, layer, pos)
                        limit, flips = pos, flips + 1
        diff = np.abs(dec[:limit] - full[:limit]).max()
        assert diff <= DECODE_TOL, (i, diff)
        worst = max(worst, float(diff))
    print(f"{name}: decode vs full max diff {worst:.2e}; DSA tie flips that cut the check: {flips}")


@pytest.mark.parametrize("name", DSA_NAMES)
def test_f32_dsa_selections_match_oracle(name: str, oracle_dir: Path, models: Any) -> None:
    """Indexer selections vs the oracle's, margin-aware (a difference needs a gap < TIE_EPS)."""
    m, ref = models(name), _ref(oracle_dir, name)
    topk = m.config.index_topk
    n_layers = m.config.num_hidden_layers
    checked = exact = 0
    for i in _prompts(ref):
        prompt = ref[f"prompt_{i}"]
        rec = Recorder()
        ctx = StepContext(observer=rec)
        out = m.forward(prompt, m.new_cache(), ctx=ctx)
        m.mtp_forward(out.hidden[:-1], prompt[1:], m.new_mtp_cache(), ctx=ctx)
        for key in [k for k in ref if k.startswith(f"dsa_topk_{i}_")]:
            tag = key[len(f"dsa_topk_{i}_") :]
            layer = n_layers if tag == "mtp" else int(tag.split("_")[1])
            want, scores = ref[key], ref[f"dsa_scores_{i}_{tag}"]
            got = rec.events[("dsa_select", layer)][0]
            for row in range(want.shape[0]):
                want_set = {int(t) for t in want[row] if t >= 0}
                got_set = set(np.flatnonzero(got[row, : row + 1]).tolist())
                checked += 1
                if got_set == want_set:
                    exact += 1
                else:
                    assert _boundary_gap(scores[row], topk) < TIE_EPS, (key, row)
    assert checked > 0
    print(f"{name}: DSA rows checked {checked}, identical sets {exact}")


@pytest.mark.parametrize("name", NAMES)
def test_f32_mtp_logits(name: str, oracle_dir: Path, models: Any) -> None:
    m, ref = models(name), _ref(oracle_dir, name)
    assert m.has_mtp
    worst = 0.0
    for i in _prompts(ref):
        prompt = ref[f"prompt_{i}"]
        hidden = m.forward(prompt, m.new_cache()).hidden
        got = m.mtp_forward(hidden[:-1], prompt[1:], m.new_mtp_cache())
        diff = float(np.abs(got - ref[f"mtp_logits_{i}"]).max())
        assert diff <= LOGIT_TOL, (i, diff)
        worst = max(worst, diff)
        topk = getattr(m.config, "index_topk", len(prompt))
        if len(prompt) - 1 <= topk:  # incremental MTP == full MTP (no DSA tie in play)
            cache = m.new_mtp_cache()
            rows = [m.mtp_forward(hidden[t : t + 1], prompt[t + 1 : t + 2], cache)
                    for t in range(len(prompt) - 1)]  # fmt: skip
            assert np.abs(np.concatenate(rows) - got).max() <= DECODE_TOL
    print(f"{name}: MTP max |logit diff| {worst:.2e}")


@pytest.mark.parametrize("name", NAMES)
def test_multi_token_step_is_bit_identical_to_decode(
    name: str, oracle_dir: Path, models: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A speculative-verify-like step (k tokens at once) equals k one-token decode steps bit for
    bit when Linear is batch-invariant (here: a row-by-row stand-in for the kernels)."""
    import runtime.linear

    inner = runtime.linear.Linear.__call__

    def rowwise(self: Any, x: np.ndarray, **kw: Any) -> np.ndarray:
        return np.concatenate([inner(self, x[i : i + 1], **kw) for i in range(x.shape[0])])

    monkeypatch.setattr(runtime.linear.Linear, "__call__", rowwise)
    m, ref = models(name), _ref(oracle_dir, name)
    prompt, nxt = ref["prompt_1"], ref["greedy_1"][:6]  # 12 + 6 > index_topk: DSA active
    assert mla.prefer_absorbed(m.dims, len(nxt), len(prompt) + len(nxt))
    a, b = m.new_cache(), m.new_cache()
    m.forward(prompt, a)
    m.forward(prompt, b)
    many = m.forward(nxt, a).logits
    ones = np.concatenate([m.forward(nxt[i : i + 1], b).logits for i in range(len(nxt))])
    np.testing.assert_array_equal(many, ones)


@pytest.mark.parametrize("name", NAMES)
def test_expert_source_called_once_per_layer_with_sorted_union(
    name: str, oracle_dir: Path, containers: Any
) -> None:
    c = containers(name, "f32")
    inner = ResidentExperts(c)
    calls: list[tuple[int, list[int]]] = []

    class Spy:
        def wants_lookahead(self, layer: int) -> bool:
            return False

        def arrivals(self, layer: int, experts: Any, lookahead: Any = None) -> Any:
            assert lookahead is None  # no prediction for a source that does not ask for it
            calls.append((layer, list(experts)))
            return inner.arrivals(layer, experts)

        def map_arrivals(self, *args: Any) -> Any:
            raise AssertionError("a serial context computes experts in arrival order")

        def prefetch(self, layer: int, experts: Any) -> None:
            raise AssertionError("no lookahead for a source that does not ask for it")

    m = load_model(c, Spy())
    route: dict[int, np.ndarray] = {}
    ctx = StepContext(
        observer=lambda ev, layer, arr: route.__setitem__(layer, arr) if ev == "route" else None
    )
    m.forward(_ref(oracle_dir, name)["prompt_1"], m.new_cache(), ctx=ctx)
    moe_layers = [i for i in range(m.config.num_hidden_layers) if m.config.is_moe_layer(i)]
    assert [layer for layer, _ in calls] == moe_layers
    for layer, experts in calls:
        assert experts == sorted(set(route[layer].ravel().tolist()))


def test_unsupported_model_type_is_a_clear_error(containers: Any) -> None:
    c = containers("deepseek_v3", "f32")

    fake = SimpleNamespace(config=dict(c.config, model_type="llama"))
    with pytest.raises(ModelError, match="not supported"):
        load_model(fake)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- quantized


def _dequantized_reference(name: str, oracle_dir: Path, c: Container) -> tuple[Any, Any]:
    """transformers model + MTP block whose every parameter is the container's dequantized one."""
    from transformers import AutoConfig

    tool = _oracle_tool()
    config = AutoConfig.from_pretrained(oracle_dir / name)
    config._attn_implementation = "eager"
    model = tool._model_classes(name)["causal_lm"](config).eval()
    mtp = tool.make_mtp_layer(name, config).eval()
    n_exp, inter = c.arch.n_routed_experts, c.arch.moe_intermediate_size

    def fill(module: Any, prefix: str) -> None:
        params = dict(module.named_parameters()) | dict(module.named_buffers())
        with torch.no_grad():
            for pname, p in params.items():
                if pname.endswith("inv_freq"):
                    continue
                full = prefix + pname
                if full.endswith("mlp.experts.gate_up_proj"):
                    base = full[: -len("gate_up_proj")]
                    val = np.stack([
                        np.concatenate([c.load_f32(f"{base}{e}.gate_proj.weight"),
                                        c.load_f32(f"{base}{e}.up_proj.weight")])
                        for e in range(n_exp)
                    ])  # fmt: skip
                    assert val.shape[1] == 2 * inter
                elif full.endswith("mlp.experts.down_proj"):
                    base = full[: -len("down_proj")]
                    val = np.stack(
                        [c.load_f32(f"{base}{e}.down_proj.weight") for e in range(n_exp)]
                    )
                else:
                    val = c.load_f32(full)
                p.copy_(torch.from_numpy(np.asarray(val, np.float32).reshape(p.shape)))

    fill(model, "")
    fill(mtp, f"model.layers.{config.num_hidden_layers}.")
    return model, mtp


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    def logsm(x: np.ndarray) -> np.ndarray:
        z = x - x.max(axis=-1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))

    lp, lq = logsm(p_logits.astype(np.float64)), logsm(q_logits.astype(np.float64))
    return float((np.exp(lp) * (lp - lq)).sum(axis=-1).mean())


@pytest.mark.parametrize("name", NAMES)
def test_quantized_matches_dequantized_reference(
    name: str, oracle_dir: Path, containers: Any, models: Any
) -> None:
    c = containers(name, "q")
    m = models(name, "q")
    ref = _ref(oracle_dir, name)
    tool = _oracle_tool()
    hf, mtp = _dequantized_reference(name, oracle_dir, c)
    worst = worst_mtp = 0.0
    kls = []
    for i in _prompts(ref):
        prompt = ref[f"prompt_{i}"]
        want, want_hidden = tool.forward_full(hf, prompt.tolist())
        want_mtp = tool.mtp_forward(hf, mtp, prompt.tolist(), want_hidden).numpy()
        out = m.forward(prompt, m.new_cache())
        diff = float(np.abs(out.logits - want.numpy()).max())
        assert diff <= LOGIT_TOL, (i, diff)
        got_mtp = m.mtp_forward(out.hidden[:-1], prompt[1:], m.new_mtp_cache())
        diff_mtp = float(np.abs(got_mtp - want_mtp).max())
        assert diff_mtp <= LOGIT_TOL, (i, diff_mtp)
        worst, worst_mtp = max(worst, diff), max(worst_mtp, diff_mtp)
        kls.append(_kl(ref[f"logits_{i}"], out.logits))
    print(
        f"{name}: quantized vs dequantized reference max diff {worst:.2e} (MTP {worst_mtp:.2e}); "
        f"KL(f32 || quantized) per prompt {[f'{k:.4f}' for k in kls]}"
    )
