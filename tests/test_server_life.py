"""specee-server's lifecycle: --sleep-idle-seconds (the model unloaded when idle and loaded again by the next request
that needs it, read-only endpoints answered without it), --host a,b (one socket each), and router mode (a child
server per model of --models-dir / --models-preset, routed by the request's `model`, at most --models-max running).
Every server binds 127.0.0.1 (or ::1), is stopped by the test that started it, and every wait is bounded."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from specee.paths import default_model_path
from specee.server.app import make_parser, parse_args
from specee.server.router import child_base_args, flag_args, models_dir_sources, preset_sources
from test_convert_cli import bpe_dir, bpe_gguf  # noqa: F401 (fixtures of chat_gguf: a tiny BPE Llama, its GGUF)
from test_server import Server, call, chat_gguf  # noqa: F401 (chat_gguf: a fixture)

KEY = {"Authorization": "Bearer k"}


def wait_for(check, what: str, seconds: float = 20.0) -> None:
    for _ in range(int(seconds / 0.1)):
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {seconds} s")


def sleeping(server: Server) -> bool:
    r = call(server.port, "GET", "/props")
    assert r.status_code == 200
    return r.json()["is_sleeping"]


def metrics(server: Server) -> dict[str, float]:
    text = call(server.port, "GET", "/metrics").text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}


# ---- --sleep-idle-seconds ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sleepy(chat_gguf: Path) -> Iterator[Server]:  # noqa: F811
    s = Server(chat_gguf, "-np", "2", "-c", "256", "--temp", "0", "--metrics", "--sleep-idle-seconds", "1",
               "--no-jinja", "--ngram-cache", "0")
    yield s
    s.stop()


def test_an_idle_server_sleeps_and_the_next_generation_wakes_it_with_the_same_output(sleepy: Server) -> None:
    body = {"prompt": [5, 6, 7], "n_predict": 6}
    before = call(sleepy.port, "POST", "/completion", body).json()
    wait_for(lambda: sleeping(sleepy), "asleep")
    # read-only endpoints answer from what the server keeps, and leave it asleep
    assert call(sleepy.port, "GET", "/health").status_code == 200
    models = call(sleepy.port, "GET", "/v1/models").json()["data"]
    assert models[0]["meta"]["n_vocab"] > 0
    asleep = metrics(sleepy)
    assert asleep["llamacpp:tokens_predicted_total"] == before["tokens_predicted"]
    assert sleeping(sleepy)
    after = call(sleepy.port, "POST", "/completion", body).json()  # loads the model again
    assert not sleeping(sleepy)
    assert after["content"] == before["content"] and after["tokens_predicted"] == before["tokens_predicted"]
    awake = metrics(sleepy)  # counters carry across the sleep
    assert awake["llamacpp:tokens_predicted_total"] == 2 * before["tokens_predicted"]
    assert awake["specee:passes_total"] > asleep["specee:passes_total"]


def test_the_rate_gauges_cover_the_time_since_the_last_scrape(sleepy: Server) -> None:
    call(sleepy.port, "POST", "/completion", {"prompt": [5, 6, 7], "n_predict": 6})
    assert metrics(sleepy)["llamacpp:predicted_tokens_seconds"] > 0
    assert metrics(sleepy)["llamacpp:predicted_tokens_seconds"] == 0  # nothing ran since


def test_token_counting_wakes_the_model(sleepy: Server) -> None:
    wait_for(lambda: sleeping(sleepy), "asleep")
    r = call(sleepy.port, "POST", "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    assert not sleeping(sleepy)


def test_a_model_that_cannot_be_loaded_again_is_a_503(chat_gguf: Path, tmp_path: Path) -> None:  # noqa: F811
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(chat_gguf, copy)
    s = Server(copy, "-c", "256", "-np", "1", "--sleep-idle-seconds", "1")
    try:
        wait_for(lambda: sleeping(s), "asleep")
        copy.unlink()
        r = call(s.port, "POST", "/completion", {"prompt": [5, 6], "n_predict": 2})
        assert r.status_code == 503 and "could not be loaded again" in r.json()["error"]["message"]
        assert call(s.port, "GET", "/health").status_code == 200 and sleeping(s)
    finally:
        s.stop()


def test_sleep_seconds_must_be_positive_or_minus_one() -> None:
    for value in ("0", "-2", "soon"):
        with pytest.raises(SystemExit):
            parse_args(["--sleep-idle-seconds", value])
    assert parse_args(["--sleep-idle-seconds", "-1"]).sleep_idle_seconds == -1


# ---- --host a,b ---------------------------------------------------------------------------------------


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
def test_every_address_of_host_is_listened_on(chat_gguf: Path) -> None:  # noqa: F811
    s = Server(chat_gguf, "--host", "127.0.0.1,::1", "--api-key", "k", "-c", "256", "-np", "1")
    try:
        import http.client

        for host in ("127.0.0.1", "::1"):
            conn = http.client.HTTPConnection(host, s.port, timeout=30)
            conn.request("POST", "/completion", body='{"prompt": [5, 6], "n_predict": 2}', headers=KEY)
            r = conn.getresponse()
            assert r.status == 200 and r.read()
            conn.close()
    finally:
        s.stop()


def test_an_address_that_cannot_be_bound_ends_the_start_naming_it(chat_gguf: Path) -> None:  # noqa: F811
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "specee.server", "-m", str(chat_gguf), "--port", str(port),
                              "-c", "256", "-np", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and f"cannot listen on 127.0.0.1 port {port}" in out.stderr


# ---- router mode: its sources -------------------------------------------------------------------------


def test_models_dir_lists_files_and_folders(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "a-mmproj.gguf").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "big").mkdir()
    for part in ("big-00002-of-00002.gguf", "big-00001-of-00002.gguf", "mmproj-big.gguf"):
        (tmp_path / "big" / part).write_bytes(b"")
    (tmp_path / "empty").mkdir()
    found = models_dir_sources(str(tmp_path))
    assert sorted(found) == ["a", "big"]
    assert found["a"].args == ["--model", str(tmp_path / "a.gguf")]
    assert found["big"].args == ["--model", str(tmp_path / "big" / "big-00001-of-00002.gguf")]
    with pytest.raises(ValueError, match="not a directory"):
        models_dir_sources(str(tmp_path / "a.gguf"))


def test_a_preset_section_becomes_a_childs_flags(tmp_path: Path) -> None:
    ini = tmp_path / "p.ini"
    ini.write_text("; models\n[*]\nctx-size = 512\n\n[one]\nmodel = /m/one.gguf  # the file\njinja = false\n"
                   "metrics = true\nload-on-startup = 1\nalias = uno,eins\n\n[two]\nhf-repo = org/two\n")
    found = preset_sources(str(ini), make_parser())
    assert found["one"].args == ["--ctx-size", "512", "--model", "/m/one.gguf", "--no-jinja", "--metrics"]
    assert found["one"].load_on_startup and found["one"].aliases == ["uno", "eins"]
    assert found["two"].args == ["--ctx-size", "512", "--hf-repo", "org/two"]  # refused by the child, at its start
    assert found["two"].preset.startswith("[two]\n")


@pytest.mark.parametrize("text, message", [
    ("[x]\nno-such-flag = 1\n", "no-such-flag: not a flag"),
    ("[x]\nmodels-dir = /m\n", "models-dir: not a flag"),
    ("[x]\nmetrics = maybe\n", "expected true or false"),
    ("[x]\nmodel = a\n[x]\nmodel = b\n", "already exists"),
])
def test_a_bad_preset_is_refused_naming_what(tmp_path: Path, text: str, message: str) -> None:
    ini = tmp_path / "p.ini"
    ini.write_text(text)
    with pytest.raises(ValueError, match=message):
        preset_sources(str(ini), make_parser())


def test_router_flags_with_a_model_file_are_refused() -> None:
    for argv in (["-m", "x.gguf", "--models-dir", "/m"], ["-m", "x.gguf", "--no-models-autoload"],
                 ["--models-max", "-1"], ["--models-dir", "/m", "-a", "name"]):
        with pytest.raises(SystemExit):
            parse_args(argv)


def test_children_get_the_routers_flags_but_its_own() -> None:
    argv = ["--models-dir", "/m", "--temp", "0", "--host=0.0.0.0", "--port", "9", "--api-key", "k",
            "--no-models-autoload", "-c", "512", "--models-max", "2"]
    assert child_base_args(argv, make_parser()) == ["--temp", "0", "-c", "512"]
    assert flag_args("ctx-size", "1", make_parser(), "here") == ["--ctx-size", "1"]


# ---- router mode: a child server per model ------------------------------------------------------------


class Router(Server):
    """specee-server started without -m (router mode) on 127.0.0.1."""

    def __init__(self, *args: str) -> None:  # noqa: super().__init__ starts a one-model server
        self.start("router", *args)

    def statuses(self) -> dict[str, str]:
        data = call(self.port, "GET", "/models", headers=KEY).json()["data"]
        return {m["id"]: m["status"]["value"] for m in data}


@pytest.fixture()
def models_dir(chat_gguf: Path, tmp_path: Path) -> Path:  # noqa: F811
    folder = tmp_path / "models"
    folder.mkdir()
    for name in ("a", "b"):
        os.symlink(chat_gguf, folder / f"{name}.gguf")
    return folder


def chat(router: Router, model: str) -> tuple[int, dict]:
    r = call(router.port, "POST", "/v1/chat/completions",
             {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, headers=KEY)
    return r.status_code, r.json()


def test_router_starts_a_child_per_model_and_evicts_the_least_recently_used(models_dir: Path) -> None:
    router = Router("--models-dir", str(models_dir), "--models-max", "1", "--api-key", "k", "-c", "256", "-np", "1",
                    "--temp", "0", "-t", "1", "--no-jinja")
    try:
        props = call(router.port, "GET", "/props", headers=KEY).json()
        assert props["role"] == "router" and props["max_instances"] == 1 and props["models_autoload"] is True
        assert router.statuses() == {"a": "unloaded", "b": "unloaded"}
        assert call(router.port, "GET", "/models").status_code == 401  # the router checks the key
        status, out = chat(router, "a")
        assert status == 200 and out["model"] == "a" and out["choices"][0]["message"]["content"]
        assert router.statuses() == {"a": "loaded", "b": "unloaded"}
        status, again = chat(router, "b")  # --models-max 1: a goes
        assert status == 200 and again["model"] == "b"
        assert again["choices"][0]["message"]["content"] == out["choices"][0]["message"]["content"]  # one file
        assert router.statuses() == {"a": "unloaded", "b": "loaded"}
        tokens = call(router.port, "POST", "/tokenize", {"model": "b", "content": "hi"}, headers=KEY).json()
        assert tokens["tokens"]
        assert call(router.port, "GET", "/slots?model=b", headers=KEY).status_code in (200, 501)  # a child's GET
        status, err = chat(router, "c")
        assert status == 400 and err["error"]["message"] == "model 'c' not found"
        assert chat(router, "")[1]["error"]["message"] == "model name is missing from the request"
        r = call(router.port, "POST", "/models/unload", {"model": "b"}, headers=KEY)
        assert r.status_code == 200 and r.json() == {"success": True}
        assert router.statuses() == {"a": "unloaded", "b": "unloaded"}
        assert call(router.port, "POST", "/models/unload", {"model": "b"}, headers=KEY).status_code == 400
        # nothing is downloaded, so there are no downloaded models to remove
        assert call(router.port, "POST", "/models", {"model": "org/x"}, headers=KEY).status_code == 400
        assert call(router.port, "DELETE", "/models?model=a", headers=KEY).status_code == 400
        assert call(router.port, "DELETE", "/models?model=zz", headers=KEY).status_code == 404
        # ?reload=1 reads the folder again
        os.symlink(models_dir / "a.gguf", models_dir / "c.gguf")
        (models_dir / "a.gguf").unlink()
        assert router.statuses() == {"a": "unloaded", "b": "unloaded"}
        data = call(router.port, "GET", "/models?reload=1", headers=KEY).json()["data"]
        assert [m["id"] for m in data] == ["b", "c"]
    finally:
        router.stop()
    assert router.proc.stdout is not None
    log = router.proc.stdout.read()
    assert log.count("specee-server: a on http://127.0.0.1:") == 1  # each child's start line


def test_a_routers_children_end_with_it_even_when_it_is_killed(models_dir: Path) -> None:
    router = Router("--models-dir", str(models_dir), "-c", "256", "-np", "1", "-t", "1")
    try:
        assert chat(router, "a")[0] == 200
        children = Path(f"/proc/{router.proc.pid}/task/{router.proc.pid}/children").read_text().split()
        assert len(children) == 1
        router.proc.kill()  # no chance to stop its children itself
        router.proc.wait(timeout=15)
        wait_for(lambda: not Path(f"/proc/{children[0]}").exists()
                 or "Z" in Path(f"/proc/{children[0]}/stat").read_text().split()[2], "the child ended", 30)
    finally:
        router.stop()


def test_without_autoload_a_model_is_loaded_by_request(models_dir: Path) -> None:
    router = Router("--models-dir", str(models_dir), "--no-models-autoload", "-c", "256", "-np", "1", "-t", "1")
    try:
        status, err = chat(router, "a")
        assert status == 400 and err["error"]["message"] == "model is not loaded"
        r = call(router.port, "POST", "/models/load", {"model": "a"})
        assert r.status_code == 200 and r.json() == {"success": True}
        assert router.statuses()["a"] == "loaded"
        assert call(router.port, "POST", "/models/load", {"model": "a"}).status_code == 400  # already running
        assert call(router.port, "POST", "/models/load", {"model": "zz"}).status_code == 404
        assert chat(router, "a")[0] == 200
    finally:
        router.stop()


def test_a_model_whose_server_cannot_start_reports_it(tmp_path: Path) -> None:
    ini = tmp_path / "p.ini"
    ini.write_text("[remote]\nhf-repo = org/model\n")  # nothing is downloaded: the child refuses -hf
    router = Router("--models-preset", str(ini), "-c", "256", "-t", "1")
    try:
        status, err = chat(router, "remote")
        assert status == 500 and "did not start" in err["error"]["message"]
        model = call(router.port, "GET", "/models").json()["data"][0]
        assert model["status"]["failed"] is True and model["status"]["exit_code"] == 2
        assert model["source"] == "preset" and "hf-repo = org/model" in model["status"]["preset"]
    finally:
        router.stop()


def test_without_router_flags_no_model_file_means_the_default_model() -> None:
    server = Router("-c", "256", "-np", "1", "-t", "1")  # no -m and no router flag: the one-model server
    try:
        props = call(server.port, "GET", "/props").json()
        assert "role" not in props and props["model_path"] == default_model_path() and props["is_sleeping"] is False
    finally:
        server.stop()
