"""`coli list` (models and their state dirs, nothing loaded) and `coli ps` (a running server's
model, queue, slots and tiers through its API), as real subprocesses against a real server."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
from _cli import coli
from _demo import demo_model
from _serve import Server


def test_list_shows_models_and_their_state(tmp_path: Path) -> None:
    models = tmp_path / "models"
    shutil.copytree(demo_model(), models / "glm")
    (models / "notes").mkdir()  # not a model: skipped
    r = coli("list", str(models), "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    [entry] = got["models"]
    assert entry["model_type"] == "glm_moe_dsa" and entry["converted"]
    assert entry["state_dir"] is None and entry["shard_bytes"] > 0
    # after a run the engine keeps learned routing in the model's state dir
    run = coli("run", "--model", str(models / "glm"), "-n", "4", "Hello", home=tmp_path)
    assert run.returncode == 0, run.stderr
    stray = tmp_path / ".cache" / "colibri" / "gone-12345678"
    stray.mkdir(parents=True)
    (stray / ".coli_kv.0").write_bytes(b"x" * 100)
    (stray / ".coli_chat.default.json").write_text("{}")
    # a config.json naming no model_type is listed as unusable (it looked healthy: "?, 0 layers")
    (models / "odd").mkdir()
    (models / "odd" / "config.json").write_text('{"num_hidden_layers": 2}')
    r = coli("list", str(models), home=tmp_path)
    assert r.returncode == 0, r.stderr
    cfg = json.loads((models / "glm" / "config.json").read_text())
    shape = f"{cfg['num_hidden_layers']} layers x {cfg['n_routed_experts']} experts"
    assert f"{models / 'glm'}\n    glm_moe_dsa, {shape}" in r.stdout
    # the state dir by path (text output never said where it is)
    state = json.loads(coli("list", str(models), "--json", home=tmp_path).stdout)["models"]
    where = next(m["state_dir"] for m in state if m["path"].endswith("glm"))
    assert f"(container); state: usage in {where}" in r.stdout
    # chat sessions are counted
    assert f"{stray}: no usage yet, 1 chat session(s), 1 KV file(s), 100 B" in r.stdout
    assert f"{models / 'odd'}\n    unusable: config.json: names no model_type" in r.stdout
    # --json gives the same, the KV bytes too
    doc = json.loads(coli("list", str(models), "--json", home=tmp_path).stdout)
    assert {
        "path": str(stray), "usage": False, "kv_files": 1, "kv_bytes": 100, "chat_sessions": 1,
    } in doc["other_state_dirs"]  # fmt: skip
    assert doc["models"][0]["kv_bytes"] == 0
    bad = coli("list", str(tmp_path / "nope"), home=tmp_path)
    assert bad.returncode == 1 and "does not exist" in bad.stderr
    afile = coli("list", str(models / "glm" / "config.json"), home=tmp_path)
    assert afile.returncode == 1 and "not a directory" in afile.stderr


def test_ps_reports_what_a_server_holds(tmp_path: Path) -> None:
    r = coli("ps", "--url", "http://127.0.0.1:9", home=tmp_path)
    assert r.returncode == 1 and "no colibri server answers" in r.stderr
    assert "hint: start one with `coli serve`" in r.stderr
    srv = Server(
        tmp_path, "--api-key", "k1", "--kv-slots", "2", "--ram", "4600KiB",
        "--kv-dir", str(tmp_path / "kv"),
    ).wait_ready()  # fmt: skip
    try:
        name = httpx.get(srv.url + "/health", timeout=10).json()["model"]
        body = {"model": name, "prompt": "w5 w6", "max_tokens": 3, "cache_slot": 1}
        done = httpx.post(srv.url + "/v1/completions", json=body, timeout=60,
                          headers={"authorization": "Bearer k1"})  # fmt: skip
        assert done.status_code == 200, done.text
        denied = coli("ps", "--url", srv.url, home=tmp_path)
        wrong = coli("ps", "--url", srv.url, "--api-key", "k2", home=tmp_path)
        r = coli("ps", "--url", srv.url, "--api-key", "k1", home=tmp_path)
        j = coli("ps", "--url", srv.url, "--api-key", "k1", "--json", home=tmp_path)
        key_file = tmp_path / "key"
        key_file.write_text("# the server's key\nk1\n")
        from_file = coli("ps", "--url", srv.url, "--api-key-file", str(key_file), home=tmp_path)
        # no scheme: http (it said no server answers there)
        bare = coli("ps", "--url", srv.url.removeprefix("http://"), "--api-key", "k1",
                    home=tmp_path)  # fmt: skip
    finally:
        srv.stop()
    assert denied.returncode == 1 and "needs an API key" in denied.stderr
    assert wrong.returncode == 1 and "refused the API key" in wrong.stderr
    bad_url = coli("ps", "--url", "http://[::1", home=tmp_path)
    assert bad_url.returncode == 1 and "is not a URL" in bad_url.stderr
    assert "Traceback" not in bad_url.stderr
    assert r.returncode == 0, r.stderr
    assert from_file.returncode == 0, from_file.stderr
    assert bare.returncode == 0 and bare.stdout == r.stdout, bare.stderr
    assert from_file.stdout.splitlines()[0] == r.stdout.splitlines()[0]
    assert f"server     {srv.url}  model {name}" in r.stdout
    assert "experts    streaming:" in r.stdout and "hit rate" in r.stdout
    assert "slot 0     0 tokens" in r.stdout
    slot1 = next(line for line in r.stdout.splitlines() if line.startswith("slot 1"))
    assert "0 tokens" not in slot1 and "1 turns" in slot1
    st = json.loads(j.stdout)
    assert st["slots"][1]["tokens"] > 0 and st["engine"]["experts"]["mode"] == "streaming"


def test_list_shows_a_model_whose_config_is_broken(tmp_path: Path) -> None:
    """A directory whose config.json does not parse (or holds text where a count goes) is
    listed with the problem, not left out as if it were not there."""
    models = tmp_path / "models"
    (models / "cut").mkdir(parents=True)
    (models / "cut" / "config.json").write_text('{"num_hidden_layers": 4')
    (models / "text").mkdir()
    (models / "text" / "config.json").write_text('{"num_hidden_layers": "abc"}')
    r = coli("list", str(models), home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"{models / 'cut'}\n    unusable: config.json:" in r.stdout
    assert f"{models / 'text'}\n    unusable: config.json:" in r.stdout
    got = json.loads(coli("list", str(models), "--json", home=tmp_path).stdout)
    assert [m["problem"] is not None for m in got["models"]] == [True, True]
