"""Speculative decoding on the demo model: tokens per forward and tokens/s, drafting off vs
MTP, prompt lookup, grammar-forced spans and auto, fully resident and streaming.

Workloads (greedy, so every mode emits the same tokens):

* text: a few prompts, half of them repetitive (prompt lookup finds matches there);
* json: a JSON Schema with long required keys (the grammar forces most of the output).

Modes: ``off``, ``mtp`` (``mtp:3``), ``mtp1`` (``mtp:1``), ``lookup`` (``lookup:3``),
``auto`` (the cost model picks source and k per round, off when nothing pays) on text; ``off``
and ``grammar`` (auto: forced spans as drafts) on json. Each mode runs ``--rounds`` times
interleaved, the order of the text modes rotating between rounds (a streaming run leaves the
expert cache warm for the next). The machine is shared and noisy, so each mode's tokens/s is
summarised by its median over the rounds (``best`` and ``spread`` = (max - min) / median are
reported too); ``auto_over_best_fixed`` = auto's median / the highest median of the fixed text
modes (off, mtp:3, mtp:1, lookup:3); ``..._best_round`` is the same ratio of best rounds. The
last line is JSON: ``figure`` = ``auto_over_best_fixed`` resident, ``figure_streaming`` the
same streaming, with every number in ``details``.

    python tools/bench/speculative.py [--model DIR] [--tokens 48] [--rounds 8] [--budget 16MiB]
                                      [--settings resident,streaming]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import numpy as np  # noqa: E402
from _args import positive  # noqa: E402

import colibri  # noqa: E402
from colibri._engine import DoneEvent  # noqa: E402
from runtime.grammar import GrammarSpec  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "the_answer_to_the_question": {"type": "integer", "minimum": 0, "maximum": 99},
        "how_sure_the_model_is": {"enum": ["very sure", "not sure"]},
        "a_short_comment": {"type": "string", "maxLength": 24},
    },
    "required": ["the_answer_to_the_question", "how_sure_the_model_is", "a_short_comment"],
    "additionalProperties": False,
}
TEXT_MODES = {
    "off": "off",
    "mtp": "mtp:3",
    "mtp1": "mtp:1",
    "lookup": "lookup:3",
    "auto": "auto",
}
FIXED = ("off", "mtp", "mtp1", "lookup")
JSON_MODES = {"off": "off", "grammar": "auto"}


def prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    out = []
    for i in range(n):
        p = [int(x) for x in rng.integers(3, 999, size=8)]
        out.append(p * 3 if i % 2 else p)
    return out


async def run_mode(
    eng: colibri.Engine, ps: list[list[int]], draft: str, tokens: int, grammar: Any
) -> dict[str, Any]:
    before = eng.stats()["speculative"]
    n_tok = 0
    t0 = time.perf_counter()
    outs = []
    for p in ps:
        async for ev in eng.generate(p, max_new_tokens=tokens, draft=draft, grammar=grammar):
            if isinstance(ev, DoneEvent):
                n_tok += len(ev.tokens)
                outs.append(ev.tokens)
    dt = time.perf_counter() - t0
    after = eng.stats()["speculative"]
    steps = (after["verify_steps"] + after["plain_steps"]) - (
        before["verify_steps"] + before["plain_steps"]
    )
    rounds_tokens = after["tokens"] - before["tokens"]
    return {
        "tokens_per_s": n_tok / dt,
        "tokens": n_tok,
        "seconds": dt,
        # steps of the decoder (drafting off runs plain decoding: one forward per token)
        "tokens_per_forward": rounds_tokens / steps if steps else 1.0,
        "accepted": {k: after["accepted"][k] - before["accepted"][k] for k in after["accepted"]},
        "proposed": {k: after["proposed"][k] - before["proposed"][k] for k in after["proposed"]},
        "outputs": outs,
    }


async def bench(model: Path | None, budget: str | None, tokens: int, rounds: int) -> dict:
    opts = colibri.EngineOptions(learn=False, ram_budget=budget, reader="threads")
    async with colibri.Engine.open(model, options=opts) as eng:
        text, js = prompts(4), prompts(2)[:1] * 2
        spec = GrammarSpec.json_schema(SCHEMA)
        await run_mode(eng, text[:1], "off", 8, None)  # warm up kernels
        # ... and the JSON prompts' first run (without, it fell in json-off's first round:
        # its median low, grammar_over_off high)
        await run_mode(eng, js[:1], "off", 8, spec)
        runs: dict[str, list[dict[str, Any]]] = {}
        names = list(TEXT_MODES)
        for rnd in range(rounds):
            # rotate the order: a streaming run leaves the expert cache warm for the next one
            for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                runs.setdefault(name, []).append(
                    await run_mode(eng, text, TEXT_MODES[name], tokens, None)
                )
            # rotated too: in streaming the first leaves the expert cache warm for the second
            json_names = list(JSON_MODES)
            k = rnd % len(json_names)
            for name in json_names[k:] + json_names[:k]:
                runs.setdefault(f"json-{name}", []).append(
                    await run_mode(eng, js, JSON_MODES[name], tokens, spec)
                )
        ref = runs["off"][0]["outputs"]
        same = all(r["outputs"] == ref for m in TEXT_MODES for r in runs[m])
        jref = runs["json-off"][0]["outputs"]
        same &= all(r["outputs"] == jref for m in ("json-off", "json-grammar") for r in runs[m])
        modes: dict[str, dict[str, Any]] = {}
        for name, rs in runs.items():
            tps = [r["tokens_per_s"] for r in rs]
            # the median round's own numbers (tokens, seconds, acceptance: one measurement),
            # the lower of the middle two with an even count; its rate is the mode's (np.median
            # averaged two rounds, which contradicted the tokens / seconds beside it)
            mid = sorted(rs, key=lambda r: r["tokens_per_s"])[(len(rs) - 1) // 2]
            med = float(mid["tokens_per_s"])
            del mid["outputs"]
            modes[name] = {
                **mid,
                "tokens_per_s": med,
                "best": max(tps),
                "spread": (max(tps) - min(tps)) / med,
                "rounds": [round(x, 1) for x in tps],
            }
        mode = eng.stats()["experts"]["mode"]
        fixed = max(modes[m]["tokens_per_s"] for m in FIXED)
        fixed_best = max(modes[m]["best"] for m in FIXED)
        return {
            "mode": mode,
            "budget": budget,
            "same_output": same,
            "auto_over_best_fixed": modes["auto"]["tokens_per_s"] / fixed,
            "auto_over_best_fixed_best_round": modes["auto"]["best"] / fixed_best,
            "auto_over_off": modes["auto"]["tokens_per_s"] / modes["off"]["tokens_per_s"],
            "grammar_over_off": modes["json-grammar"]["tokens_per_s"]
            / modes["json-off"]["tokens_per_s"],
            "modes": modes,
            "cost_model": eng.stats()["speculative"]["cost_model"],
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="default: the bundled demo model")
    ap.add_argument("--tokens", type=positive, default=48)
    ap.add_argument("--rounds", type=positive, default=8)
    ap.add_argument("--budget", default="16MiB", help="RAM budget of the streaming run")
    ap.add_argument("--settings", default="resident,streaming", help="which settings to run")
    args = ap.parse_args(argv)
    settings = {"resident": None, "streaming": args.budget}
    unknown = sorted(set(args.settings.split(",")) - set(settings))
    if unknown:
        ap.error(f"--settings: unknown {', '.join(unknown)} (choose from resident, streaming)")
    results = {}
    for name in args.settings.split(","):
        res = anyio.run(bench, args.model, settings[name], args.tokens, args.rounds)
        results[name] = res
        line = {k: v for k, v in res.items() if k not in ("modes", "cost_model")}
        for key in ("tokens_per_s", "best", "spread", "tokens_per_forward"):
            line[key] = {k: round(v[key], 2) for k, v in res["modes"].items()}
        print(json.dumps(line))
    first = next(iter(results.values()))
    print(
        json.dumps(
            {
                "figure": first["auto_over_best_fixed"],
                "figure_is": f"auto / best fixed mode, median tokens/s, text, {first['mode']}",
                "figure_streaming": results["streaming"]["auto_over_best_fixed"]
                if "streaming" in results
                else None,
                "details": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
