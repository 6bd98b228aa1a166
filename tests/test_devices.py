"""Layers across devices (csrc/model/specee-placement.cpp) with a real second device: a specee-rpc-server process on
127.0.0.1, started and stopped by the fixture. -ngl in both offload orders gives the CPU's logits and tokens;
EAGLE and early exit (per-layer KV validity) work with layers on both sides; the errors are clear."""

from __future__ import annotations

import gc
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import specee
from specee import EagleParams, ExitParams
from specee._tools import free_port, tool_path
from specee.paths import default_draft_head_path
from kv_probes import kv_cell_pos, kv_cell_valid

# logits of the same graphs on the RPC server's CPU backend and on this process's: the same kernels, so equal but
# for the order of a few sums (measured: 0.0 on SmolLM2 and the tiny model)
ATOL = 1e-4


@pytest.fixture(scope="module")
def rpc_server(tmp_path_factory: pytest.TempPathFactory):
    """A specee-rpc-server on 127.0.0.1 (its default address) and a free port, with a time limit of its own; stopped
    when the module's tests are done. Its output goes to a file (it logs every connection, and a pipe nobody reads
    would fill and stop it)."""
    port = free_port()
    log = tmp_path_factory.mktemp("rpc") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(tool_path("specee-rpc-server")), "-p", str(port), "-t", "1", "--timeout", "1200"],
                                stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert proc.poll() is None, log.read_text()
        time.sleep(0.1)
    yield f"127.0.0.1:{port}"
    gc.collect()  # a model still holding buffers on the server frees them before it stops
    proc.terminate()
    proc.wait(timeout=30)


def listening_on(port: int) -> list[str]:
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
    return [line.split()[3] for line in out.splitlines() if line.strip()]


def test_the_server_binds_loopback_only(rpc_server: str) -> None:
    port = int(rpc_server.rsplit(":", 1)[1])
    addrs = listening_on(port)
    assert addrs == [f"127.0.0.1:{port}"], addrs


def test_the_server_wants_a_token_to_listen_elsewhere(tmp_path: Path) -> None:
    """Any address but loopback needs a token: without one the server refuses to start (it binds nothing)."""
    env = {k: v for k, v in os.environ.items() if k != "SPECEE_RPC_TOKEN"}
    proc = subprocess.run([str(tool_path("specee-rpc-server")), "-H", "0.0.0.0", "-p", str(free_port()), "--timeout",
                           "1"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1 and "give a token" in proc.stderr, proc.stderr


def check_ngl(path: Path, order: str, device: str, atol: float, **model_kwargs) -> None:
    """-ngl 0, 1, half, all and more than all in one offload order: the CPU's logits (within atol) and greedy tokens,
    and the layers on `device` (a name's prefix: RPC, CUDA) where the order puts them. tests/test_gpu.py uses it too."""
    cpu = specee.Model(path, n_ctx=128, n_threads=1, n_gpu_layers=0)
    tokens = [1, 5, 17, 42, 7, 99, 3]
    want = cpu.eval(tokens, output="all")
    want_gen = cpu.generate_tokens(tokens, 24, temp=0)
    n_layer = cpu.n_layer
    for k in (0, 1, n_layer // 2, n_layer, n_layer + 1):
        with specee.Model(path, n_ctx=128, n_threads=1, n_gpu_layers=k, offload_order=order, **model_kwargs) as m:
            where = re.search(rf"^{device}\d* \([^)]*\): ((layers [0-9-]+, )?output)?", m.placement, re.M)
            assert (where is not None) == (k > 0), m.placement
            np.testing.assert_allclose(m.eval(tokens, output="all"), want, rtol=0, atol=atol)
            m.kv_clear()
            assert m.generate_tokens(tokens, 24, temp=0) == want_gen, (order, k, m.placement)
            # first: layers 0..k-1 and the output; last: as llama.cpp counts, the output and layers n-k+1..
            span = (0, min(k, n_layer) - 1) if order == "first" else (n_layer + 1 - k, n_layer - 1)
            want_layers = None if span[1] < span[0] else \
                f"layers {span[0]}, " if span[0] == span[1] else f"layers {span[0]}-{span[1]}, "
            if k > 0:
                assert where.group(1) and where.group(2) == want_layers, (k, m.placement)


@pytest.mark.parametrize("order", ["first", "last"])
def test_ngl_gives_the_cpus_logits_and_tokens(tiny_gguf: Path, rpc_server: str, order: str) -> None:
    check_ngl(tiny_gguf, order, "RPC", ATOL, rpc_servers=[rpc_server])


@pytest.fixture(scope="module")
def exit_model(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path, tiny_hf_dir: Path) -> Path:
    """The tiny model with a random EAGLE head and random predictors merged in (test_early_exit's)."""
    import json

    import torch
    from safetensors.torch import save_file

    from specee.convert.merge import merge_gguf
    from test_convert_cli import eagle_state
    from test_eagle import save_published

    cfg = json.loads((tiny_hf_dir / "config.json").read_text())
    d = tmp_path_factory.mktemp("rpc_exit")
    folder = save_published(eagle_state(cfg, seed=3), cfg, d / "head")
    g = torch.Generator().manual_seed(0)
    preds = {}
    for il in range(cfg["num_hidden_layers"] - 1):
        preds[f"model.layers.{il}.pred.up.weight"] = torch.randn(512, 12, generator=g) * 0.3
        preds[f"model.layers.{il}.pred.up.bias"] = torch.zeros(512)
        preds[f"model.layers.{il}.pred.down.weight"] = torch.randn(1, 512, generator=g) * 0.3
        preds[f"model.layers.{il}.pred.down.bias"] = torch.zeros(1)
    save_file(preds, d / "pred.safetensors")
    out = d / "tiny-exit.gguf"
    merge_gguf(tiny_gguf, out, eagle=folder, eagle_type="f32", predictors=d / "pred.safetensors", progress=False)
    return out


def replayed_exits(model: specee.Model, prompt: list[int]) -> tuple[list[int], list[int]]:
    """Early exit with a replayed schedule (layer 3 of 4: no exit): each exited token's cell is valid exactly up to
    its exit layer; returns the tokens and the layers each ran. tests/test_gpu.py uses it too."""
    model.kv_clear()
    out = model.generate_tokens(prompt, 12, mode="early-exit", temp=0, ignore_eos=True,
                                exit=ExitParams(replay=[0, 3, 1, 2, 0, 3]))
    cells = {kv_cell_pos(model, c): c for c in range(model.n_ctx) if kv_cell_pos(model, c) >= 0}
    for k, ran in enumerate(model.last_stats.layers_run):
        cell = cells[len(prompt) + k]  # decode step k evaluated generated token k, at position P + k
        assert [kv_cell_valid(model, cell, il) for il in range(model.n_layer)] == \
            [il < ran for il in range(model.n_layer)], (model.placement, k)
    return out, list(model.last_stats.layers_run)


@pytest.mark.parametrize("order", ["first", "last"])
def test_eagle_and_early_exit_on_a_split(exit_model: Path, rpc_server: str, order: str,
                                         request: pytest.FixtureRequest) -> None:
    """EAGLE greedy output equals plain greedy output with half the layers on the server; a replayed exit schedule
    leaves each exited token's cell valid exactly up to its exit layer, on both devices, and gives the CPU's
    tokens."""
    cpu = specee.Model(exit_model, n_ctx=128, n_threads=1, n_gpu_layers=0)
    m = specee.Model(exit_model, n_ctx=128, n_threads=1, n_gpu_layers=2, offload_order=order, rpc_servers=[rpc_server])
    request.addfinalizer(m.close)
    assert "RPC" in m.placement and "CPU" in m.placement
    prompt = [1, 5, 17, 42, 7, 99]
    plain = m.generate_tokens(prompt, 24, mode="plain", temp=0)
    assert plain == cpu.generate_tokens(prompt, 24, mode="plain", temp=0)
    for mode, eagle in (("eagle", EagleParams(choices="[[0], [1], [0, 0]]")),
                        ("eagle2", EagleParams(total_tokens=4, depth=3, topk=2))):
        m.kv_clear()
        assert m.generate_tokens(prompt, 24, mode=mode, temp=0, eagle=eagle) == plain, mode
    split = replayed_exits(m, prompt)
    assert split == replayed_exits(cpu, prompt)
    assert split[1][:6] == [1, 4, 2, 3, 1, 4]


def test_list_devices_shows_the_server(rpc_server: str) -> None:
    r = subprocess.run([str(tool_path("llama-cli")), "--rpc", rpc_server, "--list-devices"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert re.search(rf"RPC\d+: {re.escape(rpc_server)} \(\d+ MiB, \d+ MiB free\)", r.stdout), r.stdout
    assert "CPU:" in r.stdout
    specee._core.rpc_add_servers(rpc_server)  # this process too (whether or not an earlier test added it)
    assert any(name.startswith("RPC") for name, *_ in specee._core.devices())


@pytest.mark.parametrize("args,message", [
    (["--rpc", "127.0.0.1:1"], "cannot reach the ggml RPC server at 127.0.0.1:1"),
    (["--rpc", "localhost"], "bad RPC server 'localhost': expected HOST:PORT"),
    (["-ts", "1,x"], "invalid value for -ts"),
    (["--device", "GPU7"], "unknown device 'GPU7'"),
    (["--offload-order", "middle"], "invalid value for --offload-order"),
])
def test_bad_placement_flags(tiny_gguf: Path, args: list[str], message: str) -> None:
    r = subprocess.run([str(tool_path("llama-cli")), "-m", str(tiny_gguf), "-p", "hi", "-n", "1", *args],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and message in r.stderr, r.stderr


def test_ngl_above_the_layer_count_is_clamped_and_said(tiny_gguf: Path, rpc_server: str) -> None:
    with specee.Model(tiny_gguf, n_ctx=64, n_threads=1, n_gpu_layers=99, rpc_servers=[rpc_server]) as m:
        assert "-ngl 99 is more than the model's 4 layers and its output: all are offloaded" in m.placement
        assert "CPU" not in m.placement.split("offload order")[0]
    with pytest.raises(specee.SpecEEError, match="--tensor-split gives 3 shares for 1 devices"):
        specee.Model(tiny_gguf, n_ctx=64, n_gpu_layers=2, rpc_servers=[rpc_server], tensor_split=[1, 2, 3])


@pytest.mark.slow
@pytest.mark.parametrize("order", ["first", "last"])
def test_cli_on_smollm2_with_the_server(smollm2_path: Path, rpc_server: str, order: str) -> None:
    """-ngl 16 over the RPC server, in either order: greedy output equal to CPU-only on 6 prompts (with ggml's kernels
    on both sides, --kernels off: the server's layers run ggml's mul_mat, this process's Q4_1 layers this runtime's
    own sums otherwise, which agree within rounding, not bit for bit: docs/kernels.md); with the shipped head and
    predictors, early exit runs on the split and reports its histogram."""
    from specee.bench.spec import mt_bench_prompts

    prompts = [p.text for p in mt_bench_prompts("smollm2")[:6]]
    base = ["-m", str(smollm2_path), "-n", "24", "--temp", "0", "-no-cnv", "--no-display-prompt", "-c", "512",
            "-t", "1"]
    cli = str(tool_path("llama-cli"))
    for prompt in prompts:
        cpu = subprocess.run([cli, *base, "--kernels", "off", "-p", prompt, "-ngl", "0"], capture_output=True,
                             timeout=300)
        split = subprocess.run([cli, *base, "--kernels", "off", "-p", prompt, "-ngl", "16", "--offload-order", order,
                                "--rpc", rpc_server], capture_output=True, timeout=300)
        assert split.returncode == 0 and split.stdout == cpu.stdout, split.stderr.decode()[-500:]
    ee = subprocess.run([cli, *base, "-p", prompts[0], "-ngl", "16", "--rpc", rpc_server, "--draft-head",
                         default_draft_head_path(), "--mode", "early-exit"], capture_output=True, text=True, timeout=300)
    assert ee.returncode == 0, ee.stderr
    assert "offload order first" in ee.stderr  # auto: the draft head file has exit predictors
    assert re.search(r"load: RPC\d+ \(127\.0\.0\.1:\d+\): layers 0-15, output, draft head", ee.stderr), ee.stderr
    assert "mode early-exit" in ee.stderr and "exit histogram = layers run:tokens" in ee.stderr
