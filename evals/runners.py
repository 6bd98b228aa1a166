"""Decoding modes: one `Runner` per mode generates a reply to a rendered prompt and says how long it took.

All modes get the same GGUF, prompt text (rendered with the model's chat template), max tokens, sampling
settings and threads. The registry `MODES` maps a mode's name to the function that makes its runner; a mode
whose function is None is listed as not available in this build.

Timings: prefill = the prompt's evaluation; decode = the rest. Decode tokens are the generated tokens after the
first (which comes from the prompt's logits), plus one when an end-of-generation token ended the reply (its
evaluation was timed too); llama.cpp's "eval time ... / N runs" counts the same evaluations.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, Protocol

import specee
from specee import _core
from specee.bench.perf import parse_perf


class ModeError(Exception):
    """A mode that cannot run here (not in this build, or its tool is missing or failed)."""


def _eval_options() -> specee.GenerateOptions:
    return specee.GenerateOptions(temp=0.0, seed=0)  # greedy, and a fixed seed where a mode samples


@dataclass
class RunConfig:
    model: str  # GGUF path
    max_tokens: int = 128
    threads: int = 2
    n_ctx: int = 4096
    type_v: str = "f32"
    draft_head: str | None = None
    llama_cli: str | None = None
    llama_cli_args: str = ""
    exit_draft_head: str | None = None  # draft head file with exit predictors for mode early-exit (None: the model
    # file's, or draft_head)
    # sampling, trees and exit settings: the runtime's options (each mode takes its own part)
    options: specee.GenerateOptions = field(default_factory=_eval_options)


@dataclass
class Turn:
    """One generated reply."""

    text: str
    tokens: list[int]  # generated ids (llama.cpp through its CLI: the reply's text tokenized again)
    n_prompt: int
    prompt_seconds: float
    n_decode: int
    decode_seconds: float
    stop_reason: str  # "eog", "length", "context", "stop"
    step_tokens: list[int] = field(default_factory=list)  # speculative: tokens returned by each step
    layers_run: list[int] = field(default_factory=list)  # early exit: layers evaluated per decoded token
    exit_correct: list[bool] = field(default_factory=list)  # early exit: token == the full model's, per token


class Runner(Protocol):
    def generate(self, prompt: str) -> Turn: ...

    def close(self) -> None: ...


def decode_count(n_generated: int, stop_reason: str) -> int:
    return max(n_generated - 1, 0) + (1 if stop_reason == "eog" and n_generated > 0 else 0)


# ---- this runtime: plain, EAGLE, early exit -------------------------------------------------------


class NativeRunner:
    """This runtime in one of its modes (specee.MODES; each sample from an empty KV cache, as a user runs the CLI)."""

    def __init__(self, model: specee.Model, cfg: RunConfig, mode: str) -> None:
        self.model, self.cfg, self.mode = model, cfg, mode
        o = cfg.options
        info = specee.MODES[mode]
        eagle = o.eagle  # each mode gets the settings it reads: EAGLE-2's tree where it reads both (tree exit)
        eagle = (specee.EagleParams(total_tokens=eagle.total_tokens, depth=eagle.depth, topk=eagle.topk)
                 if "eagle2_tree" in info.reads else specee.EagleParams(choices=eagle.choices)
                 if "eagle1_tree" in info.reads else specee.EagleParams())
        self.options = replace(o, mode=mode, eagle=eagle, exit=o.exit if "exit" in info.reads else specee.ExitParams())
        if info.needs_head and not model.has_eagle:
            raise ModeError(f"mode {mode} needs an EAGLE head: {cfg.model} has none; pass --draft-head "
                            "HEAD.gguf (a draft head file, `python -m specee.convert merge --draft-head-only`)")

    def generate(self, prompt: str) -> Turn:
        m, c = self.model, self.cfg
        tokens = m.tokenize(prompt, add_special=True, parse_special=True)
        m.kv_clear()
        o = self.options
        out = m.generate_tokens(tokens, c.max_tokens, **{f.name: getattr(o, f.name) for f in fields(o)})
        st = m.last_stats
        turn = Turn(m.detokenize(out), out, st.n_prompt, st.t_prompt_ms / 1e3,
                    decode_count(st.n_generated, st.stop_reason), st.t_decode_ms / 1e3, st.stop_reason,
                    list(st.step_tokens))
        if specee.MODES[self.mode].exits:  # a tree mode: each token gets its step's layers run
            turn.layers_run = list(st.layers_run)
            turn.exit_correct = self.full_model_agrees(tokens, out, st.stop_reason == "eog", len(st.layers_run))
        return turn

    def full_model_agrees(self, prompt: list[int], out: list[int], eog: bool, n_steps: int) -> list[bool]:
        """Per early-exit decode step, whether its token is the full model's greedy token on the same context
        (one pass of all layers over the prompt and the reply, after the timed generation). Step i produced
        out[i + 1] (out[0] came from the prompt pass), or the end token after the last one."""
        m = self.model
        if n_steps == 0:
            return []
        seq = prompt + out
        mask = [False] * len(seq)
        for i in range(n_steps):
            mask[len(prompt) + i] = True
        m.kv_clear()
        best = m.eval(seq, output=mask).argmax(axis=1)
        m.kv_clear()
        want = out[1:n_steps + 1]
        agree = [int(b) == t for b, t in zip(best, want)]
        if eog and len(agree) < n_steps:
            agree.append(m.is_eog(int(best[len(agree)])))
        return agree

    def close(self) -> None:
        pass


# ---- upstream llama.cpp: its CLI, or llama-cpp-python --------------------------------------------


END_OF_TEXT = " [end of text]\n"  # llama-completion's line after an end-of-generation token


def cli_reply(stdout: str) -> tuple[str, str]:
    """(reply, stop reason) from llama-completion's stdout with --no-display-prompt: the generated text, then
    " [end of text]" when generation ended, then a blank line."""
    text = stdout[:-2] if stdout.endswith("\n\n") else stdout
    if text.endswith(END_OF_TEXT):
        return text[: -len(END_OF_TEXT)], "eog"
    return text, "length"


class LlamaCliRunner:
    """Upstream's non-interactive tool (llama-completion; llama-cli in older builds), one process per reply.
    Its own timing lines give prefill and decode times (model loading is not counted, as here)."""

    def __init__(self, model: specee.Model, cfg: RunConfig) -> None:
        self.model, self.cfg = model, cfg

    def argv(self, prompt: str) -> list[str]:
        c, o = self.cfg, self.cfg.options
        return [c.llama_cli, "-m", c.model, "-p", prompt, "-n", str(c.max_tokens), "-t", str(c.threads),
                "-tb", str(c.threads), "-c", str(c.n_ctx), "-b", "512", "-ub", "512", "--temp", str(o.temp),
                "--top-k", str(o.top_k), "--top-p", str(o.top_p), "--min-p", str(o.min_p), "--repeat-penalty", "1.0",
                "-s", str(o.seed), "-fa", "on", "-ctv", c.type_v, "-no-cnv", "--no-display-prompt", "--no-escape",
                *shlex.split(c.llama_cli_args)]

    def generate(self, prompt: str) -> Turn:
        argv = self.argv(prompt)
        proc = subprocess.run(argv, capture_output=True, stdin=subprocess.DEVNULL)
        stderr = proc.stderr.decode("utf-8", errors="replace")
        if proc.returncode != 0:
            hint = ""
            if proc.returncode in (-4, 132):
                hint = ("\n(SIGILL: upstream's AMX/extra-buffer repacking of quantized weights; pass "
                        "--llama-cli-args=--no-repack, or use an F16 GGUF)")
            raise ModeError(f"llama.cpp: {shlex.join(argv[:3])} ... failed (exit {proc.returncode}):\n"
                            f"{stderr[-1500:]}{hint}")
        try:
            p_ms, p_n, e_ms, e_n = parse_perf(stderr)
        except ValueError as e:
            raise ModeError(f"llama.cpp: {self.cfg.llama_cli}: {e}\n{stderr[-1500:]}") from None
        text, stop = cli_reply(proc.stdout.decode("utf-8", errors="replace"))
        tokens = self.model.tokenize(text, add_special=False, parse_special=False)
        return Turn(text, tokens, p_n, p_ms / 1e3, e_n, e_ms / 1e3, stop)

    def close(self) -> None:
        pass


class LlamaCppPythonRunner:
    """Upstream through the llama-cpp-python package (when installed), in a worker process of its own
    (llama_worker.py: the package's libggml and this runtime's cannot share a process). The prompt's token ids
    come from this runtime's tokenizer (the same vocabulary), the times from llama.cpp's own counters."""

    def __init__(self, model: specee.Model, cfg: RunConfig) -> None:
        self.model, self.cfg = model, cfg
        eog = [t for t in range(model.n_vocab) if model.is_eog(t)]
        setup = {"model": cfg.model, "n_ctx": cfg.n_ctx, "threads": cfg.threads, "seed": cfg.options.seed,
                 "eog": eog}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("llama_worker.py")),
                                      json.dumps(setup)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def generate(self, prompt: str) -> Turn:
        c, o = self.cfg, self.cfg.options
        tokens = self.model.tokenize(prompt, add_special=True, parse_special=True)
        req = {"tokens": tokens, "max_tokens": c.max_tokens, "temp": o.temp, "top_k": o.top_k,
               "top_p": o.top_p, "min_p": o.min_p, "seed": o.seed}
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise ModeError(f"llama.cpp: the llama-cpp-python worker ended (exit {self.proc.wait()}); see its "
                            "messages above")
        r = json.loads(line)
        return Turn(self.model.detokenize(r["tokens"]), r["tokens"], r["n_p_eval"], r["t_p_eval_ms"] / 1e3,
                    r["n_eval"], r["t_eval_ms"] / 1e3, r["stop"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ---- the registry ------------------------------------------------------------------------------


# the evaluations' flags that set what each group of the runtime's settings reads (specee.MODES[...].reads)
def _flags(*names: str) -> str:
    """The options' first flags as the runtime's table spells them."""
    rows = {o["name"]: o for o in _core.generator_options()}
    return "/".join(rows[name]["flags"][0] for name in names)


FLAGS = {"eagle1_tree": _flags("eagle.choices"),
         "eagle2_tree": _flags("eagle.total_tokens", "eagle.depth", "eagle.topk"),
         "exit": "--exit-draft-head, " + _flags("exit.threshold", "exit.layers", "exit.kv") + "/--exit-replay/--exit-check",
         "ngram": "the runtime's n-gram defaults"}


def make_native(mode: str) -> Callable[[specee.Model, RunConfig], Runner]:
    """The runner of one of the runtime's modes, its needs read off the mode table."""
    info = specee.MODES[mode]

    def make(model: specee.Model, cfg: RunConfig) -> Runner:
        if info.exits and (not model.has_eagle or (not model.has_exit_predictors and not cfg.options.exit.replay)):
            raise ModeError(f"mode {mode} needs an EAGLE head and exit predictors: pass --exit-draft-head HEAD.gguf, a "
                            "draft head file made with `python -m specee.convert merge BASE.gguf -o HEAD.gguf --eagle "
                            "HEAD --predictors PREDICTORS --draft-head-only` (or a model file with both merged in)")
        if info.greedy_only and cfg.options.temp > 0:
            raise ModeError(f"mode {mode} decodes greedily: use --temp 0")
        return NativeRunner(model, cfg, mode)

    return make


def make_llama_cpp(model: specee.Model, cfg: RunConfig) -> Runner:
    if cfg.llama_cli:
        return LlamaCliRunner(model, cfg)
    if importlib.util.find_spec("llama_cpp") is not None:
        return LlamaCppPythonRunner(model, cfg)
    raise ModeError("mode llama.cpp needs upstream llama.cpp: pass --llama-cli PATH (its llama-completion) "
                    "or install llama-cpp-python")


def describe(info: specee.Mode) -> str:
    flags = ", ".join(FLAGS.get(r, r + ".*") for r in info.reads)
    return f"this runtime: {info.help}" + (", greedy" if info.greedy_only else "") + (f" ({flags})" if flags else "")


# the runtime's modes (auto aside: it resolves to one of them) and upstream llama.cpp; a mode whose function is None
# is listed as not available in this build
MODES: dict[str, tuple[str, Callable[[specee.Model, RunConfig], Runner] | None]] = {
    **{name: (describe(info), make_native(name)) for name, info in specee.MODES.items() if name != "auto"},
    "llama.cpp": ("upstream llama.cpp on the same GGUF (--llama-cli PATH, or llama-cpp-python)", make_llama_cpp),
}


def make_runner(name: str, model: specee.Model, cfg: RunConfig) -> Runner:
    if name not in MODES:
        raise ModeError(f"unknown mode {name!r} (modes: {', '.join(MODES)})")
    make = MODES[name][1]
    if make is None:
        raise ModeError(f"mode {name} ({MODES[name][0]}) is not available in this build")
    return make(model, cfg)
