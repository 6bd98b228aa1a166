"""Tree exit (csrc/decode/specee-tree-exit.cpp, mode tree-exit): SpecEE's early exit inside the EAGLE tree's
verification pass, on the tiny model with a random head and random predictors. Replayed exits give the exit layer's
logits (against an explicit masked forward and the runtime's own layer-range evaluation), the walk over them follows the
tree down to its leaves (replayed acceptance), never exiting is EAGLE-2 and plain decoding, the skipped layers' cache
follows the KV policy, bad use is refused, and the CLI runs it on the default model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import specee
from specee import EagleParams, ExitParams
from specee import _core
from safetensors.torch import save_file

from specee.convert.merge import merge_gguf
from test_eagle import cfg, random_gguf, random_state  # noqa: F401  (fixtures: a random head without predictors)
from test_eagle3 import random_predictors, trained_gguf  # noqa: F401  (an EAGLE-3 head trained on the tiny model)
from test_early_exit import (PROMPTS, check_against_masked_forward, forward_with_filled_kv,  # noqa: F401
                             predictors, with_head)
from kv_probes import kv_cell_pos, kv_cell_valid

N_CTX = 256
TREES = [EagleParams(total_tokens=6, depth=3, topk=2), EagleParams(choices="[[0], [1], [0, 0], [0, 1]]")]
TREE_IDS = ["eagle2-6-3-2", "eagle1-4"]


def tree_exit(m: specee.Model, prompt: list[int], n: int, eagle: EagleParams, schedule: list[int] | None = None,
              **exit_kw) -> tuple[list[int], specee.GenerationStats]:
    """n tokens of greedy tree exit from an empty cache; `schedule`: a replayed exit layer per step (-1: none)."""
    replay = [m.n_layer - 1 if x < 0 else x for x in schedule] if schedule else None
    m.kv_clear()
    out = m.generate_tokens(prompt, n, temp=0, mode="tree-exit", ignore_eos=True, eagle=eagle,
                            exit=ExitParams(replay=replay, **exit_kw))
    return [int(t) for t in out], m.last_stats


def step_layers(st: specee.GenerationStats) -> list[int]:
    """The exit layer of each step's pass (every token of a step gets its pass's layers run)."""
    layers, i = [], 0
    for k in st.step_tokens:
        assert len(set(st.layers_run[i:i + k])) == 1, st.layers_run[i:i + k]
        layers.append(st.layers_run[i] - 1)
        i += k
    return layers


def layer_logits(hf, h: np.ndarray) -> np.ndarray:
    """final norm + lm_head of hidden states [n, n_embd] with the reference weights"""
    x = torch.from_numpy(np.asarray(h, dtype=np.float32))
    w, eps = hf.model.norm.weight.detach(), hf.config.rms_norm_eps
    return ((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w) @ hf.lm_head.weight.detach().T).numpy()


def assert_argmax(logits: np.ndarray, got: int, what) -> None:
    want = int(np.argmax(logits))
    # equal, or a floating-point near-tie between the runtime (F32 weights, F16 K cache) and the reference
    assert got == want or float(logits[want] - logits[got]) < 0.02, (what, got, want)


# ---- (1) a replayed exit gives the exit layer's logits, and the walk over them follows the tree


@pytest.mark.parametrize("eagle", TREES, ids=TREE_IDS)
def test_replayed_exits_give_the_exit_layers_tokens(with_head: Path, tiny_hf, llama_forward,
                                                    eagle: EagleParams) -> None:
    """Every emitted token is the argmax, at the exit layer of the pass that drew it, of a forward whose masks hide
    layer il of every token whose pass stopped before il; each step's pass stops where the replay says."""
    m = specee.Model(str(with_head), n_ctx=N_CTX, n_threads=1)
    schedule = [0, -1, 1, 2, 2, -1, 0]
    for prompt in PROMPTS:
        out, st = tree_exit(m, prompt, 24, eagle, schedule, threshold=1.0)
        per_step = step_layers(st)
        want = [schedule[i % len(schedule)] for i in range(len(per_step))]
        assert per_step == [m.n_layer - 1 if x < 0 else x for x in want]
        assert st.n_exits == sum(x >= 0 for x in want) > 0
        assert st.n_layers_run == sum(x + 1 for x in per_step)
        assert st.exit_ratio == pytest.approx(st.n_exits / st.n_steps)
        assert st.mean_layers_run == pytest.approx(st.n_layers_run / st.n_steps)
        assert st.mean_accepted_tokens == pytest.approx(st.n_decoded / st.n_steps)
        layers = [r - 1 for r in st.layers_run]  # of the pass that evaluated out[k] and drew out[k + 1]
        assert check_against_masked_forward(tiny_hf, prompt, out, layers, llama_forward) > 0


def test_one_exit_layer_matches_the_runtimes_layer_range(with_head: Path, tiny_hf) -> None:
    """Every pass stops after layer 1, so every cell is valid up to layer 1: each token is the argmax of the layer-1
    hidden state of a fresh Model.eval(..., layers=(0, 2)) over the sequence, through the final norm and lm_head."""
    m = specee.Model(str(with_head), n_ctx=N_CTX, n_threads=1)
    ref = specee.Model(str(with_head), n_ctx=N_CTX, n_threads=1)
    for prompt in PROMPTS:
        out, st = tree_exit(m, prompt, 20, TREES[0], [1], threshold=1.0)
        assert st.layers_run == [2] * 19 and st.n_exits == st.n_steps
        seq = prompt + out[:-1]
        ref.kv_clear()
        ref.eval(seq, output="all", layers=(0, 2))
        logits = layer_logits(tiny_hf, ref.hidden())
        for k in range(1, len(out)):
            assert_argmax(logits[len(prompt) + k - 1], out[k], k)


def test_replayed_acceptance_walks_the_path_to_its_leaf(with_head: Path, tiny_hf, llama_forward) -> None:
    """A chain of three drafted nodes with a replayed acceptance, every pass stopping after layer 1: a step that
    accepts r drafts ends with the target's token at the r-th node's row, computed from that row at layer 1 (the
    leaf, which EAGLE never expands, included: tree exit gives it candidates too)."""
    m = specee.Model(str(with_head), n_ctx=N_CTX, n_threads=1)
    replay = [2, 0, 3, 1]
    eagle = EagleParams(choices="[[0], [0, 0], [0, 0, 0]]", replay=replay)
    for prompt in PROMPTS:
        out, st = tree_exit(m, prompt, 30, eagle, [1], threshold=1.0)
        steps = st.step_tokens
        # the steps that began with room for the whole chain and its token (later ones draft a cut tree)
        n_full = next(i for i in range(len(steps) + 1) if i == len(steps) or sum(steps[:i]) + 4 > len(out) - 1)
        assert n_full >= 6 and steps[:n_full] == [replay[i % 4] + 1 for i in range(n_full)], steps
        assert st.n_accepted >= sum(replay[i % 4] for i in range(n_full))
        assert "output text is meaningless" in st.mode_why
        assert sum(kv_cell_pos(m, c) >= 0 for c in range(m.n_ctx)) == len(prompt) + len(out) - 1
        # the target's own tokens: argmax of the causal forward at layer 1 (every cell is valid up to layer 1)
        _, hiddens = llama_forward(tiny_hf, prompt + out)
        logits = layer_logits(tiny_hf, hiddens[1])
        end = 0
        for i, k in enumerate(steps[:n_full]):
            end += k  # out[end] (out[0] came from the prompt's pass) was drawn at the row of out[end - 1]
            assert_argmax(logits[len(prompt) + end - 1], out[end], (i, end))


# ---- (2) never exiting is EAGLE-2 (or EAGLE-1) and plain decoding


@pytest.mark.parametrize("eagle", TREES + [EagleParams()], ids=TREE_IDS + ["default"])
def test_never_exiting_is_eagle_and_plain(with_head: Path, eagle: EagleParams) -> None:
    m = specee.Model(str(with_head), n_ctx=N_CTX, n_threads=1)
    mode = "eagle" if eagle.choices else "eagle2"
    for prompt in PROMPTS:
        plain = m.generate_tokens(prompt, 24, temp=0, mode="plain", ignore_eos=True)
        spec = m.generate_tokens(prompt, 24, temp=0, mode=mode, ignore_eos=True, eagle=eagle)
        spec_steps = m.last_stats.step_tokens
        out, st = tree_exit(m, prompt, 24, eagle, threshold=1.0)
        assert out == spec == plain
        assert st.step_tokens == spec_steps
        assert st.n_exits == 0 and st.n_fired == 0 and st.layers_run == [m.n_layer] * 23
        assert st.n_checks == 3 * st.n_steps  # the static layers 0-2, every pass


def test_predictor_exits_are_checked_against_the_candidates(with_head: Path, tiny_hf, llama_forward) -> None:
    """Threshold 0: every check fires on its path; a pass exits where each emitted token is a candidate, else the
    next scheduled layer is tried. The tokens still come from the exit layers, as the masked forward says."""
    m = specee.Model(str(with_head), n_ctx=N_CTX, n_threads=1)
    for prompt in PROMPTS:
        out, st = tree_exit(m, prompt, 24, TREES[0], threshold=0.0)
        assert st.n_fired == st.n_checks > 0
        assert st.n_exits + st.n_rejected >= 1
        assert st.n_exits == sum(1 for x in step_layers(st) if x < m.n_layer - 1)
        check_against_masked_forward(tiny_hf, prompt, out, [r - 1 for r in st.layers_run], llama_forward)


def test_an_eagle3_head(tiny_gguf: Path, trained_gguf: Path, tmp_path: Path) -> None:  # noqa: F811
    """An EAGLE-3 draft head file with predictors that always fire: passes exit (the head's pairs then take the exit
    layer's output for its feature layers past it), and never exiting is EAGLE-2 and plain decoding."""
    save_file(random_predictors([0, 1, 2]), tmp_path / "pred.safetensors")
    head = tmp_path / "head3.gguf"
    merge_gguf(tiny_gguf, head, eagle=trained_gguf, predictors=tmp_path / "pred.safetensors", eagle_type="f32",
               draft_head_only=True, progress=False)
    m = specee.Model(tiny_gguf, n_ctx=N_CTX, n_threads=1, type_v="f32", draft_head=head)
    assert m._model.eagle_version == 3
    out, st = tree_exit(m, PROMPTS[0], 24, TREES[0], layers=[0, 1, 2])
    assert len(out) == 24 and st.n_exits > 0 and st.n_fired == st.n_checks
    plain = m.generate_tokens(PROMPTS[1], 24, temp=0, mode="plain", ignore_eos=True)
    assert tree_exit(m, PROMPTS[1], 24, TREES[0], threshold=1.0)[0] == plain


# ---- (3) the skipped layers' cache


def test_kv_cells_follow_the_policy(with_head: Path, tiny_hf) -> None:
    m = specee.Model(str(with_head), n_ctx=N_CTX, n_threads=1)
    schedule = [0, -1, 2, 1]
    for prompt in PROMPTS[:2]:
        # mask: a kept row is valid up to its pass's exit layer, the prompt everywhere
        out, st = tree_exit(m, prompt, 20, TREES[0], schedule, threshold=1.0)
        layers = [r - 1 for r in st.layers_run]
        cells = {kv_cell_pos(m, c): c for c in range(m.n_ctx) if kv_cell_pos(m, c) >= 0}
        assert len(cells) == len(prompt) + len(out) - 1
        for p in range(len(prompt)):
            assert all(kv_cell_valid(m, cells[p], il) for il in range(m.n_layer))
        for k, layer in enumerate(layers):
            cell = cells[len(prompt) + k]
            assert [kv_cell_valid(m, cell, il) for il in range(m.n_layer)] == [il <= layer for il in range(m.n_layer)]
        # fill: every layer valid, the skipped ones' K/V from the exit layer's output (against a reference forward)
        out, st = tree_exit(m, prompt, 20, TREES[0], schedule, threshold=1.0, kv="fill")
        assert st.n_exits > 0 and st.t_fill_ms > 0
        used = [c for c in range(m.n_ctx) if kv_cell_pos(m, c) >= 0]
        assert all(kv_cell_valid(m, c, il) for c in used for il in range(m.n_layer))
        layers = [r - 1 for r in st.layers_run]
        hiddens = forward_with_filled_kv(tiny_hf, prompt + out[:-1], [m.n_layer - 1] * len(prompt) + layers)
        for k, layer in enumerate(layers):
            assert_argmax(layer_logits(tiny_hf, hiddens[layer][len(prompt) + k][None])[0], out[k + 1], k)


# ---- (4) bad use


def test_bad_use_is_refused(with_head: Path, random_gguf: Path) -> None:  # noqa: F811
    m = specee.Model(str(with_head), n_ctx=N_CTX, n_threads=1)
    with pytest.raises(specee.SpecEEError, match="tree exit decodes greedily"):
        m.generate_tokens(PROMPTS[0], 4, temp=0.8, mode="tree-exit")
    with pytest.raises(specee.SpecEEError, match="not both"):
        m.generate_tokens(PROMPTS[0], 4, temp=0, mode="tree-exit", eagle=EagleParams(choices="[[0]]", depth=2))
    with pytest.raises(specee.SpecEEError, match="exit settings are given, but the mode is eagle2"):
        m.generate_tokens(PROMPTS[0], 4, temp=0, mode="eagle2", exit=ExitParams(threshold=0.5))
    with pytest.raises(specee.SpecEEError, match="replayed exit layer 9"):
        m.generate_tokens(PROMPTS[0], 4, temp=0, mode="tree-exit", exit=ExitParams(replay=[9]))
    # auto never picks it
    m.generate_tokens(PROMPTS[0], 4, temp=0)
    assert m.last_stats.mode != "tree-exit"
    # a head without predictors: refused, unless nothing is predicted (replayed exits, a threshold never reached)
    r = specee.Model(str(random_gguf), n_ctx=N_CTX, n_threads=1)
    with pytest.raises(specee.SpecEEError, match="tree exit needs exit predictors"):
        r.generate_tokens(PROMPTS[0], 4, temp=0, mode="tree-exit")
    assert len(r.generate_tokens(PROMPTS[0], 4, temp=0, mode="tree-exit", exit=ExitParams(replay=[1]))) == 4
    plain = specee.Model(str(with_head), n_ctx=N_CTX, n_threads=1)
    gen = _core.Generator(plain._ctx, specee.GenerateOptions(mode="tree-exit", temp=0))
    with pytest.raises(specee.SpecEEError, match="call specee_generator_start first"):
        gen.next(1)


# ---- (5) the CLI on the default model


def run_cli(*args: str) -> "subprocess.CompletedProcess[str]":
    """specee-cli as its console script runs it (the default model and draft head from the environment)."""
    return subprocess.run([sys.executable, "-c", "from specee._tools import cli; cli()", *args], capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)


def test_cli_tree_exit_on_the_default_model() -> None:
    base = ["--draft-head", "default", "-p", "The capital of France is", "-n", "16", "-t", "1", "-no-cnv", "--temp",
            "0"]
    r = run_cli(*base, "--mode", "tree-exit")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mode tree-exit (SpecEE inside the EAGLE tree): lossy" in r.stderr
    spec = [line for line in r.stderr.splitlines() if "speculative =" in line]
    ee = [line for line in r.stderr.splitlines() if "early exit =" in line]
    assert len(spec) == 1 and len(ee) == 1, r.stderr[-2000:]
    steps = int(spec[0].split("=")[1].split()[0])
    assert f"early exit = {steps:5d} passes, exit ratio" in ee[0] and "mean layers run" in ee[0]
    hist = r.stderr.split("exit histogram = layers run:tokens")[1].splitlines()[0].split()
    assert sum(int(h.split(":")[1]) for h in hist) == 15  # the decoded tokens (the prompt's pass gives the first)
    bad = run_cli(*base, "--mode", "tree-exit", "--temp", "0.7")
    assert bad.returncode != 0 and "tree exit decodes greedily" in bad.stderr
