"""The GPU benchmarks (scripts/gpu-run.sh's last step): each comparison side by side with upstream llama.cpp in one
command, their tables gathered into one Markdown report under --out, with the device named and the raw figures.

  (a) plain decoding and prefill, everything on the GPU, against upstream llama-bench
  (b) EAGLE trees on the GPU, from one draft token to 60 (--eagle-total-tokens 60 --eagle-depth 6 --eagle-topk 10),
      against plain decoding and upstream
  (c) SpecEE's laptop setting: -ngl 16 --offload-order first, early exit with a replayed schedule at SpecEE's mean
      depth (24 of 32), against plain at the same placement and upstream -ngl 16; again with the GPU held to 8 GB
  (d) the pass-cost curve, N = 1..64 tokens in one pass, in single-token passes: what verification costs there
      (and what a checked exit's extra row costs: docs/early-exit.md's break-even reads it)
  (e) tree exit on the GPU: replayed acceptance (EAGLE's per-position figures for its 7B heads) and every pass
      exiting after layer 23 (24 of 32), against EAGLE-2 with the same acceptance, early exit, plain and upstream

The files are synthetic (python -m specee.convert synth: random weights, Llama-2-7B's shapes, a random draft head
and predictors): they measure cost only, never quality, and their drafts are never accepted, so (b) shows what a tree
costs per step, not what it gains; the tokens per step a real head reaches come from the CPU (docs/speculative.md;
acceptance does not depend on the machine). SmolLM2 is not used: its file (94 MiB) does not fit in what a device
call carries (64 MiB with the working tree).

  python -m specee.bench.gpu --out OUT --upstream PATH/TO/llama.cpp/bin [--small]

--small: tiny synthetic files and -ngl 0, for trying every step on a machine without a GPU."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import specee

REPLAY = "15,19,23,31,17,27,31,21"  # a mean of 24 of 32 layers run: SpecEE's reported mean exit depth on Llama-2-7B
ACCEPTED = "2,0,2,1,2,2,0,2,1,2"  # drafted tokens accepted per step (docs/early-exit.md, "Tree exit against EAGLE-2")
TREES = {  # name: specee-cli arguments (docs/speculative.md)
    "eagle-1, one draft token": "--mode eagle --eagle-choices [[0]]",
    "eagle-2 default tree": "--mode eagle2",
    "eagle-2 60 nodes": "--mode eagle2 --eagle-total-tokens 60 --eagle-depth 6 --eagle-topk 10",
}


def run(cmd: list[str], report: list[str], title: str, env: dict | None = None, timeout: int = 1200) -> None:
    """Runs one comparison, prints its output as it comes, and adds its command and output to the report."""
    line = " ".join(shlex.quote(c) for c in cmd)
    print(f"bench.gpu: {title}\n  {line}", flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    print(proc.stdout, proc.stderr[-3000:] if proc.returncode else "", sep="\n", flush=True)
    report += [f"## {title}", "", "```", line, "```", ""]
    if proc.returncode:
        report += [f"**failed** (exit {proc.returncode}):", "", "```", proc.stderr[-3000:], "```", ""]
    else:
        report += [proc.stdout.strip(), "", f"({time.time() - t0:.0f} s)", ""]


def make_files(work: Path, small: bool) -> tuple[Path, Path]:
    model, head = work / "synth-q4_0.gguf", work / "synth-q4_0-head.gguf"
    shape = ["--layers", "4", "--embd", "256", "--ff", "512", "--heads", "4", "--vocab", "2000"] if small else []
    head_extra = ["--draft-head"] + (["--draft-vocab", "256"] if small else [])
    for path, extra in ((model, []), (head, head_extra)):
        if not path.exists():
            subprocess.run([sys.executable, "-m", "specee.convert", "synth", "-o", str(path), "--type", "q4_0",
                            *shape, *extra], check=True)
    return model, head


def gpu_limited_to(gib: float) -> subprocess.Popen | None:
    """A process that holds all but `gib` GiB of the GPU's free memory until stopped (torch; None without CUDA)."""
    code = ("import sys, time, torch\n"
            "free, _ = torch.cuda.mem_get_info()\n"
            f"keep = int(free - {gib} * 2**30)\n"
            "x = torch.empty(max(keep, 0), dtype=torch.uint8, device='cuda')\n"
            "print(f'holding {keep / 2**30:.1f} GiB', flush=True)\n"
            "time.sleep(3600)\n")
    try:
        import torch
        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    print("bench.gpu:", proc.stdout.readline().strip(), flush=True)
    return proc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specee.bench.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the report (gpu-report.md), raw JSON and the files")
    ap.add_argument("--upstream", required=True, help="folder with upstream's llama-bench and llama-completion")
    ap.add_argument("--small", action="store_true", help="tiny files and -ngl 0 (no GPU: tries every step)")
    ap.add_argument("-t", "--threads", type=int, default=min(8, os.cpu_count() or 1),
                    help="CPU threads for both runtimes (default: up to 8)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("SPECEE_GPU_WORK", out.parent / "gpu-files"))
    work.mkdir(parents=True, exist_ok=True)
    up = Path(a.upstream)
    model, head = make_files(work, a.small)
    devices = [f"{name} ({desc}, {total / 2**30:.1f} GiB)" for name, desc, _, total in specee.devices()]
    ngl_all, ngl_half = ("0", "0") if a.small else ("99", "16")
    n_gen, n_prompt, prompts = ("16", "64", "2") if a.small else ("64", "512", "4")
    t = str(a.threads)
    replay = "1,3,2,3" if a.small else REPLAY  # --small: 4 layers
    report = ["# GPU benchmarks", "", f"Devices: {'; '.join(devices)}. Date: {time.strftime('%Y-%m-%d %H:%M')}.",
              f"Files: synthetic Llama-2-7B-shaped Q4_0 (random weights: cost only, never quality){' (--small)' * a.small}.",
              ""]
    rt = [sys.executable, "-m", "specee.bench.runtime", "-m", str(model), "-t", t, "-r", "3",
          "--llama-bench", str(up / "llama-bench")]
    spec = [sys.executable, "-m", "specee.bench.spec", "speed", "-m", str(model), "--draft-head", str(head),
            "--mt-bench", "0", "--humaneval", prompts, "-n", n_gen, "-t", t, "-c", "2048",
            "--llama-cli", str(up / "llama-completion")]

    run(rt + ["-ngl", "0" if a.small else f"0,{ngl_all}", "-p", n_prompt, "-n", "128", "--json", str(out / "a-plain.json")], report,
        "(a) plain decoding and prefill, all layers on the GPU (and the CPU alone), vs upstream")
    configs = [f"upstream:llama.cpp plain=-fa on --ignore-eos -ngl {ngl_all}",
               f"specee plain=--mode plain --ignore-eos -ngl {ngl_all}"]
    configs += [f"{name}={args} --ignore-eos -ngl {ngl_all}" for name, args in TREES.items()]
    run(spec + sum((["--config", c] for c in configs), []) + ["--json", str(out / "b-eagle.json")], report,
        "(b) EAGLE trees on the GPU: the cost of a step (random head: nothing accepted)")
    laptop = [f"upstream:llama.cpp plain -ngl {ngl_half}=-fa on --ignore-eos -ngl {ngl_half}",
              f"specee plain -ngl {ngl_half} first=--mode plain --ignore-eos -ngl {ngl_half} --offload-order first",
              f"early exit, replayed (24 of 32)=--mode early-exit --ignore-eos --exit-replay {replay} "
              f"-ngl {ngl_half} --offload-order first"]
    laptop_cmd = spec + sum((["--config", c] for c in laptop), [])
    run(laptop_cmd + ["--json", str(out / "c-laptop.json")], report,
        "(c) SpecEE's laptop setting: -ngl 16, early exit replayed at 24 of 32 layers")
    hog = None if a.small else gpu_limited_to(8)
    if hog:
        try:
            run(laptop_cmd + ["--json", str(out / "c-laptop-8gb.json")], report,
                "(c) the same with the GPU held to 8 GB")
        finally:
            hog.kill()
    run(rt + ["-ngl", ngl_all, "-n", "0", "--pass-cost", "2,3,4,6,8,12,16,24,32,48,64",
              "--json", str(out / "d-pass-cost.json")], report,
        "(d) the pass-cost curve on the GPU: a pass of N tokens in single-token passes")
    exit_layer = "2" if a.small else "23"
    trees = [f"upstream:llama.cpp plain=-fa on --ignore-eos -ngl {ngl_all}",
             f"specee plain=--mode plain --ignore-eos -ngl {ngl_all}",
             f"EAGLE-2, replayed=--mode eagle2 --eagle-replay {ACCEPTED} --ignore-eos -ngl {ngl_all}",
             f"early exit, replayed=--mode early-exit --exit-replay {exit_layer} --ignore-eos -ngl {ngl_all}",
             f"tree exit, replayed=--mode tree-exit --eagle-replay {ACCEPTED} --exit-replay {exit_layer} "
             f"--ignore-eos -ngl {ngl_all}"]
    run(spec + sum((["--config", c] for c in trees), []) + ["--json", str(out / "e-tree-exit.json")], report,
        "(e) tree exit on the GPU: replayed acceptance, every pass exiting after layer 23, vs EAGLE-2 and plain")
    (out / "gpu-report.md").write_text("\n".join(report) + "\n")
    print(f"bench.gpu: wrote {out / 'gpu-report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
