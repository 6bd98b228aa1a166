"""Layers on a CUDA GPU (ggml built with SPECEE_GGML=cuda): the device is listed, -ngl in both offload orders gives
the CPU's logits (within the tolerance below) and greedy tokens, EAGLE stays identical to plain decoding on the GPU
and on a CPU/GPU split, early exit's replayed schedule leaves the same KV validity as on the CPU, the draft head and
predictors go where --offload-order first puts them, and the memory printed at load is what the device lost.

Every test here is marked `gpu` and skips, saying why, where ggml lists no CUDA device (no CUDA build, no driver or no
GPU): `scripts/gpu-run.sh` runs them on a lent GPU."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

import specee
from specee import EagleParams
from specee._tools import tool_path
from test_devices import check_ngl, exit_model, replayed_exits  # noqa: F401  (exit_model: a fixture, the tiny model with a random head and predictors)

pytestmark = pytest.mark.gpu

# The tiny model's F32 weights: cuBLAS and ggml-cpu sum the same products in different orders (and cuBLAS may use
# TF32-free F32 GEMMs with other blockings): logits agree to about 1e-5 relative; 2e-3 absolute leaves room.
ATOL = 2e-3


def cuda_devices() -> list[tuple[str, str, int, int]]:
    return [d for d in specee._core.devices() if d[0].startswith("CUDA")]


@pytest.fixture(scope="module")
def gpu() -> str:
    devs = cuda_devices()
    if not devs:
        pytest.skip("no CUDA device: ggml here lists " + ", ".join(d[0] for d in specee._core.devices()) +
                    " (a GPU test needs ggml built with SPECEE_GGML=cuda, a driver and a GPU: scripts/gpu-run.sh)")
    return devs[0][0]


def test_list_devices_shows_the_gpu(gpu: str) -> None:
    r = subprocess.run([str(tool_path("llama-cli")), "--list-devices"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert re.search(rf"{gpu}: .+ \(\d+ MiB, \d+ MiB free\)", r.stdout), r.stdout


def on_gpu(placement: str, gpu: str) -> str | None:
    """What the placement line says is on the GPU: 'layers a-b, output, ...' or None."""
    m = re.search(rf"^{gpu} \([^)]*\): ([^;]*);", placement, re.M)
    return m.group(1) if m else None


@pytest.mark.parametrize("order", ["first", "last"])
def test_ngl_gives_the_cpus_logits_and_tokens(tiny_gguf: Path, gpu: str, order: str) -> None:
    check_ngl(tiny_gguf, order, "CUDA", ATOL)


@pytest.mark.parametrize("ngl", [2, 99])
def test_eagle_and_early_exit_on_the_gpu(exit_model: Path, gpu: str, ngl: int,  # noqa: F811
                                         request: pytest.FixtureRequest) -> None:
    """EAGLE-1 and EAGLE-2 greedy output equals plain greedy output with half the layers or all of them on the GPU
    (the draft head and predictors with the first layers: --offload-order first); a replayed exit schedule leaves
    each exited token's cell valid exactly up to its exit layer, and the tokens of the CPU."""
    cpu = specee.Model(exit_model, n_ctx=128, n_threads=1, n_gpu_layers=0)
    m = specee.Model(exit_model, n_ctx=128, n_threads=1, n_gpu_layers=ngl, offload_order="first")
    request.addfinalizer(m.close)
    where = on_gpu(m.placement, gpu)
    assert where is not None and "draft head" in where, m.placement
    assert ("CPU" in m.placement.split("offload order")[0]) == (ngl < m.n_layer), m.placement
    prompt = [1, 5, 17, 42, 7, 99]
    plain = m.generate_tokens(prompt, 32, mode="plain", temp=0)
    assert plain == cpu.generate_tokens(prompt, 32, mode="plain", temp=0)
    for mode, eagle in (("eagle", EagleParams(choices="[[0], [1], [0, 0]]")),
                        ("eagle2", EagleParams(total_tokens=8, depth=4, topk=2))):
        m.kv_clear()
        assert m.generate_tokens(prompt, 32, mode=mode, temp=0, eagle=eagle) == plain, mode
    assert replayed_exits(m, prompt) == replayed_exits(cpu, prompt)


def test_memory_printed_at_load_is_what_the_device_lost(tiny_gguf: Path, gpu: str) -> None:
    """The MiB the placement line prints for the GPU are the weights' buffer; the device's free memory drops by that
    much when the weights load (plus the KV cache and compute buffers the context reserves, bounded below)."""
    def free() -> int:
        return next(d[2] for d in specee._core.devices() if d[0] == gpu)

    specee.Model(tiny_gguf, n_ctx=64, n_threads=1, n_gpu_layers=99).close()  # CUDA's own context and pools first
    before = free()
    with specee.Model(tiny_gguf, n_ctx=64, n_threads=1, n_gpu_layers=99) as m:
        printed = float(re.search(rf"^{gpu} \([^)]*\): [^;]*; ([0-9.]+) MiB", m.placement, re.M).group(1))
        lost = (before - free()) / 2**20
    assert printed > 0
    # the driver hands out memory in 2 MiB pages; the context's KV (64 cells) and compute buffers are a few MiB
    assert printed - 2 <= lost <= printed + 64, (printed, lost, m.placement)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["first", "last"])
def test_smollm2_on_the_gpu(smollm2_path: Path, gpu: str, order: str) -> None:
    """-ngl 0 / 1 / 15 / all in both orders: SmolLM2's greedy tokens equal the CPU's on 8 MT-Bench prompts. Q4_1 on
    the GPU quantizes activations as the CPU does but sums in another order, so a position where the CPU's top two
    logits lie within 1e-3 may pick the other token; any other difference fails."""
    from specee.bench.spec import mt_bench_prompts

    prompts = [p.text for p in mt_bench_prompts("smollm2")[:8]]
    cpu = specee.Model(smollm2_path, n_ctx=512, n_threads=4, n_gpu_layers=0)
    want = {}
    for text in prompts:
        toks = cpu.tokenize(text)
        want[text] = (toks, cpu.generate_tokens(toks, 32, temp=0))
        cpu.kv_clear()
    for k in (1, 15, 99):
        with specee.Model(smollm2_path, n_ctx=512, n_threads=4, n_gpu_layers=k, offload_order=order) as m:
            assert on_gpu(m.placement, gpu) is not None, m.placement
            for text, (toks, ref) in want.items():
                got = m.generate_tokens(toks, 32, temp=0)
                m.kv_clear()
                if got != ref:
                    i = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
                    logits = cpu.eval(toks + ref[:i], output="last")
                    cpu.kv_clear()
                    top = np.sort(np.asarray(logits).ravel())[-2:]
                    assert top[1] - top[0] < 1e-3, (k, order, text, i)
