"""llama-server's flags (upstream's common/arg.cpp, the ones its server takes), one table: what each does here.

A script written for llama-server starts specee-server unchanged. Every row is one of:
- `sampling`: a server-wide default of a GenerateOptions field (`--temp 0.2`: requests that name no temperature get
  0.2), shown by /props; these rows are the runtime's generation options named in SAMPLING, under the spellings of
  the runtime's table (llama.cpp's), not typed here;
- `server`: honoured by the server itself, under `dest` (e.g. `--no-slots`, `--cors-origins`);
- `ignored`: accepted, and it cannot change anything here (scheduling, logging, the web UI's settings), said so in
  --help;
- `refused`: it would change behaviour this server does not have: the start fails with a message naming the flag,
  unless its value is one of `neutral` (upstream's default, or a value that asks for what happens here anyway).
The flags specee-server defines itself (-m, -c, -np, --host, --api-key, -n, the chat template flags --jinja,
--chat-template, ...) are not rows: `add_llama_flags` skips a spelling the parser already has.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from specee import _core
from specee.generate import SPEC_TYPES


@dataclass(frozen=True)
class LlamaFlag:
    flags: tuple[str, ...]  # llama-server's spellings
    hint: str | None  # its value's name; None: a switch
    use: str  # sampling, server, ignored, refused
    why: str  # --help's text: what it does here, or why it is ignored or refused
    dest: str | None = None  # sampling: the GenerateOptions field; server: the args attribute
    neutral: tuple[str, ...] = ()  # refused: values accepted, as they change nothing here


def S(flags: str, hint: str | None, use: str, why: str, dest: str | None = None, neutral: tuple[str, ...] = ()
      ) -> LlamaFlag:
    return LlamaFlag(tuple(flags.split()), hint, use, why, dest, neutral)


NO_DOWNLOAD = "models are local files here (-m FILE); nothing is downloaded"
NO_SAMPLER = "this sampler is not in the runtime's chain (temp, top-k, top-p, min-p, repeat penalty)"
SCHEDULING = "CPU scheduling only: output is the same"

# The generation options the server takes a default of for requests that name none (the draft model's and n-gram
# lookup's with them); their flags are the runtime's table's rows, spellings and all
SAMPLING = ("temp", "top_k", "top_p", "min_p", "seed", "repeat_penalty", "repeat_last_n", "ignore_eos", "logit_bias",
            "draft.n_max", "draft.n_min", "draft.p_min", "ngram.draft_max", "draft.synth_rates")
# the runtime's generation options by name: each row's flags and value placeholder (hint: None for a switch) with them
GENERATION_OPTIONS: dict[str, dict[str, Any]] = {o["name"]: o for o in _core.generator_options()}
_FLOAT, _TEXT, _FLOATS = 1, 4, 6  # enum specee_option_type


def _sampling_row(name: str) -> LlamaFlag:
    o = GENERATION_OPTIONS[name]
    return LlamaFlag(tuple(o["flags"]), o["hint"], "sampling", "requests' default: " + o["help"], name)


LLAMA_FLAGS: list[LlamaFlag] = [
    # ---- sampling: server-wide defaults of requests, from the runtime's table
    *(_sampling_row(name) for name in SAMPLING),
    S("--presence-penalty", "N", "refused", NO_SAMPLER, neutral=("0",)),
    S("--frequency-penalty", "N", "refused", NO_SAMPLER, neutral=("0",)),
    S("--typical --typical-p", "N", "refused", NO_SAMPLER, neutral=("1",)),
    S("--top-nsigma --top-n-sigma", "N", "refused", NO_SAMPLER, neutral=("-1",)),
    S("--xtc-probability", "N", "refused", NO_SAMPLER, neutral=("0",)),
    S("--xtc-threshold", "N", "refused", NO_SAMPLER, neutral=("0.1",)),
    S("--dry-multiplier", "N", "refused", NO_SAMPLER, neutral=("0",)),
    S("--dry-base", "N", "refused", NO_SAMPLER, neutral=("1.75",)),
    S("--dry-allowed-length", "N", "refused", NO_SAMPLER, neutral=("2",)),
    S("--dry-penalty-last-n", "N", "refused", NO_SAMPLER, neutral=("64",)),
    S("--dry-sequence-breaker", "STRING", "refused", NO_SAMPLER),
    S("--adaptive-target", "N", "refused", NO_SAMPLER, neutral=("-1",)),
    S("--adaptive-decay", "N", "refused", NO_SAMPLER, neutral=("0.9",)),
    S("--dynatemp-range", "N", "refused", NO_SAMPLER, neutral=("0",)),
    S("--dynatemp-exp", "N", "refused", NO_SAMPLER, neutral=("1",)),
    S("--mirostat", "N", "refused", NO_SAMPLER, neutral=("0",)),
    S("--mirostat-lr", "N", "refused", NO_SAMPLER, neutral=("0.1",)),
    S("--mirostat-ent", "N", "refused", NO_SAMPLER, neutral=("5",)),
    S("--samplers", "SAMPLERS", "refused", "the sampler chain is fixed here (penalties, top-k, top-p, min-p, temp)"),
    S("--sampler-seq --sampling-seq", "SEQUENCE", "refused", "the sampler chain is fixed here"),
    S("--grammar --grammar-file -j --json-schema -jf --json-schema-file", "GRAMMAR", "refused",
      "a server-wide grammar is not supported: requests give `grammar`, `json_schema` or `response_format`"),
    S("-bs --backend-sampling --backend_sampling", None, "ignored", "sampling runs where it runs here (the CPU)"),
    # ---- the server
    S("--slots --no-slots", None, "server", "serve GET /slots, or not (default: served)", "slots"),
    S("--props", None, "refused", "changing the server's settings with POST /props is not supported"),
    S("--embedding --embeddings", None, "server", "serve embeddings (always served here)", "embedding"),
    S("--pooling", "TYPE", "server", "the embeddings' pooling: none, mean, cls, last or rank (default: the model's "
      "{arch}.pooling_type, else mean); pooled vectors are L2-normed, none gives every token's row at /embeddings",
      "pooling"),
    S("--embd-normalize", "N", "server", "how pooled embeddings are scaled: -1 not, 0 to the int16 range, 1 taxicab, 2 "
      "Euclidean (default), p > 2 p-norm; a request's embd_normalize overrides it", "embd_normalize"),
    S("--rerank --reranking", None, "server", "serve /rerank: rank pooling, the last token's final-norm row through "
      "the file's classifier head, or its first element without one", "reranking"),
    S("--cors-origins", "ORIGINS", "server", "origins a browser may call from: comma-separated, 'localhost' (any "
      "port on localhost, 127.0.0.1, [::1]) or '*' (default: *)", "cors_origins"),
    S("--cors-methods", "METHODS", "ignored", "the methods CORS allows are GET, POST, DELETE, OPTIONS"),
    S("--cors-headers", "HEADERS", "ignored", "CORS allows any request header"),
    S("--cors-credentials --no-cors-credentials", None, "ignored", "CORS allows credentials"),
    S("--offline", None, "ignored", "nothing is ever downloaded here"),
    S("-v --verbose --log-verbose", None, "server", "log every request", "verbose"),
    S("-lv --verbosity --log-verbosity", "N", "ignored", "logging only"),
    S("--log-disable --log-jsonl --no-log-jsonl --log-prefix --no-log-prefix --log-timestamps --no-log-timestamps",
      None, "ignored", "logging only"),
    S("--log-file --log-colors --log-prompts-dir", "VALUE", "ignored", "logging only"),
    S("--ui --webui", None, "refused", "there is no web UI here"),
    S("--no-ui --no-webui", None, "ignored", "there is no web UI here"),
    S("--ui-config --webui-config --ui-config-file --webui-config-file", "JSON", "ignored", "there is no web UI here"),
    S("--no-ui-mcp-proxy --no-webui-mcp-proxy -no-ag --no-agent", None, "ignored", "there is no web UI here"),
    S("--ui-mcp-proxy --webui-mcp-proxy -ag --agent", None, "refused",
      "the web UI's MCP proxy and agent run fetches and commands on the host: not served"),
    S("--tools --tools-runtime --mcp-servers-config --mcp-servers-json", "VALUE", "refused",
      "the web UI's built-in tools and MCP servers run commands on the host: not served"),
    S("--path --api-prefix --media-path", "PATH", "refused", "static files, an API prefix and local media are not "
      "served"),
    S("--ssl-key-file --ssl-cert-file", "FNAME", "refused", "TLS is not served here: put a proxy in front"),
    S("--api-key-file", "FNAME", "server", "the API key, read from a file", "api_key_file"),
    S("--reuse-port", None, "ignored", "one process serves the port"),
    S("-to --timeout --threads-http --sse-ping-interval", "N", "ignored", "HTTP is served by uvicorn's event loop"),
    S("--tags", "STRING", "server", "comma-separated model tags, shown by /v1/models (informational)", "tags"),
    S("--models-dir", "PATH", "server", "router mode (without -m): serve each GGUF file of PATH (or sub-folder "
      "holding one) under its name, a child server per model (docs/server.md)", "models_dir"),
    S("--models-preset", "PATH", "server", "router mode (without -m): the models of an INI file, a [name] section "
      "each with llama-server's flags as keys ([*]: for every model)", "models_preset"),
    S("--models-max", "N", "server", "router mode: most models loaded at once, the least recently used unloaded "
      "first (default: 4; 0: no limit)", "models_max"),
    S("--models-autoload --no-models-autoload", None, "server", "router mode: load a model when a request names it "
      "(default), or only by POST /models/load", "models_autoload"),
    S("--sleep-idle-seconds", "SECONDS", "server", "unload the model after SECONDS without a request that needs it; "
      "the next one loads it again (default: -1, never)", "sleep_idle_seconds"),
    S("--slot-save-path", "PATH", "server", "the folder where POST /slots/{id}?action=save writes a slot's cache "
      "and restore reads it (made if missing; default: slot saving is off)", "slot_save_path"),
    S("-cb --cont-batching", None, "ignored", "continuous batching is always on"),
    S("-nocb --no-cont-batching", None, "refused", "continuous batching is always on"),
    S("--cache-prompt --no-cache-prompt", None, "ignored", "a slot's cached prompt prefix gives the same output"),
    S("--cache-reuse -sps --slot-prompt-similarity -ctxcp --ctx-checkpoints --swa-checkpoints "
      "-cms --checkpoint-min-step --kv-unified-per-slot", "N", "ignored", "prompt caching: output is the same"),
    S("-cram --cache-ram", "N", "server", "host-memory prompt cache: slots' caches about to be dropped are kept, up "
      "to N MiB (oldest dropped first), and restored for a prompt that shares a longer prefix (default: 8192, "
      "-1: no limit, 0: off)", "cache_ram"),
    S("--cache-idle-slots --no-cache-idle-slots", None, "server", "keep the idle slots' caches in the prompt cache "
      "when a request starts (with -kvu, and drop them from the slots) (default: on; needs --cache-ram)",
      "cache_idle_slots"),
    S("-kvu --kv-unified -no-kvu --no-kv-unified", None, "server",
      "every slot may use the whole KV cache (-c tokens; a request drops the idle slots' caches, and requests that "
      "together overflow it fail with 500), or each at most -c / -np tokens (the default)", "kv_unified"),
    S("--context-shift", None, "server", "a generation that fills its slot goes on: --keep tokens kept, half of the "
      "rest dropped (modes plain, ngram, draft; the others end, length)", "context_shift"),
    S("--no-context-shift", None, "ignored", "the default: a generation that fills its slot ends (length)"),
    S("--keep", "N", "server", "tokens of the prompt kept on a context shift (0; -1: all)", "keep"),
    S("--swa-full", None, "ignored", "no sliding-window cache here"),
    S("-ctk --cache-type-k", "TYPE", "refused", "the K cache is f16 here", neutral=("f16",)),
    S("-dt --defrag-thold", "N", "ignored", "deprecated upstream"),
    S("--perf --no-perf --warmup --no-warmup", None, "ignored", "timings are always kept; no warm-up pass"),
    S("-e --escape --no-escape -sp --special --verbose-prompt", None, "ignored", "command-line generation only"),
    S("--spm-infill", None, "server", "/infill puts the suffix before the prefix (the SPM order some models were "
      "trained on; default: prefix first)", "spm_infill"),
    S("-r --reverse-prompt", "PROMPT", "ignored", "command-line generation only: requests give `stop`"),
    S("--reasoning-format", "FORMAT", "server", "thoughts of a reply: auto and deepseek in "
      "message.reasoning_content, deepseek-legacy there and in content, none left in content (default: auto)",
      "reasoning_format"),
    S("-rea --reasoning", "on|off|auto", "server", "the chat template's enable_thinking: on, off, or auto = where the "
      "template thinks (default: auto)", "reasoning"),
    S("--reasoning-budget", "N", "server", "thinking budget: -1 unlimited, 0 no thinking, N > 0: the thought is closed "
      "after N tokens (default: -1)",
      "reasoning_budget"),
    S("--reasoning-effort", "LEVEL", "server", "the chat template's reasoning_effort ('default': the template's own)",
      "reasoning_effort"),
    S("--reasoning-budget-message", "MESSAGE", "server", "text put before the closing tag of a thought cut by "
      "--reasoning-budget (default: none)", "reasoning_budget_message"),
    S("--reasoning-preserve --no-reasoning-preserve", None, "ignored", "every assistant message's reasoning_content "
      "goes to the template, which renders what it renders"),
    S("--prefill-assistant --no-prefill-assistant", None, "server", "continue a chat's final assistant message, or "
      "answer after it (default: continue)", "prefill_assistant"),
    S("--skip-chat-parsing", None, "refused", "replies are always parsed for thoughts and tool calls here "
      "(--reasoning-format none leaves thoughts in content)"),
    S("--no-skip-chat-parsing", None, "ignored", "replies are always parsed for thoughts and tool calls here"),
    # ---- the model and context: what the runtime's context table (specee.context_options) does not take
    S("-hf -hfr --hf-repo -hff --hf-file -hft --hf-token -mu --model-url -dr --docker-repo", "VALUE", "refused",
      NO_DOWNLOAD),
    S("--control-vector --control-vector-scaled --control-vector-layer-range", "FNAME", "refused",
      "control vectors are not supported"),
    S("-mm --mmproj -mmu --mmproj-url", "FILE", "refused", "multimodal projectors are not supported: text only"),
    S("--no-mmproj --no-mmproj-auto --mmproj-auto --mmproj-offload --no-mmproj-offload", None, "ignored",
      "text only: no projector is ever loaded"),
    S("--rope-scaling", "TYPE", "refused", "the model's own RoPE settings are used", neutral=("none",)),
    S("--rope-scale --rope-freq-base --rope-freq-scale --yarn-orig-ctx --yarn-ext-factor --yarn-attn-factor "
      "--yarn-beta-slow --yarn-beta-fast --override-kv", "N", "refused", "the model's own settings are used"),
    S("--check-tensors", None, "ignored", "the loader checks every tensor's shape and size"),
    S("-C --cpu-mask -Cr --cpu-range --cpu-strict --prio --poll -Cb --cpu-mask-batch -Crb --cpu-range-batch "
      "--cpu-strict-batch --prio-batch --poll-batch --numa", "VALUE", "ignored", SCHEDULING),
    S("-kvo --kv-offload -nkvo --no-kv-offload --repack -nr --no-repack --no-host --op-offload --no-op-offload "
      "-cmoe --cpu-moe", None, "ignored", "placement only (-ngl, -dev): output is the same"),
    S("-ot --override-tensor -ncmoe --n-cpu-moe -ncffn --n-cpu-ffn -sm --split-mode -mg --main-gpu -fit --fit "
      "-fitt --fit-target -fitc --fit-ctx -lm --load-mode -lzm --lazy-mode", "VALUE", "ignored",
      "placement only (-ngl, -dev, -ts): output is the same"),
    S("--mlock", None, "ignored", "memory locking: output is the same"),
    # ---- a draft model (-md, -ngld: the context table's); its settings are requests' defaults (with -md only)
    S("--spec-type", "TYPE", "server", "llama.cpp's speculation types, each as the mode that serves it here: "
      + "; ".join(f"{t}: mode {m}" for t, m in SPEC_TYPES.items()) + " (mode draft needs a draft model, -md)",
      "spec_type"),
    S("--spec-synth-len", "L", "refused", "give the synthetic acceptance as rates (--spec-synth-rates)"),
    S("--spec-draft-hf -hfd -hfrd --hf-repo-draft", "VALUE", "refused", NO_DOWNLOAD),
    S("-devd --device-draft --spec-draft-device", "LIST", "refused",
      "the draft model goes to the model's devices (-dev), -ngld of its layers"),
    S("-ctkd --cache-type-k-draft --spec-draft-type-k", "TYPE", "refused", "the K cache is f16 here", neutral=("f16",)),
    S("-ctvd --cache-type-v-draft --spec-draft-type-v", "TYPE", "refused",
      "the draft model's V cache has the model's type (-ctv)"),
    S("--spec-draft-p-split --draft-p-split", "P", "refused", "a draft model drafts a chain here, not a tree",
      neutral=("0.1",)),
    S("-td --threads-draft -tbd --threads-batch-draft --spec-draft-threads --spec-draft-threads-batch "
      "--spec-draft-cpu-mask -Cd --cpu-mask-draft --spec-draft-cpu-range -Crd --cpu-range-draft "
      "--spec-draft-cpu-strict "
      "--cpu-strict-draft --spec-draft-prio --prio-draft --spec-draft-poll --poll-draft --spec-draft-cpu-mask-batch "
      "-Cbd --cpu-mask-batch-draft --spec-draft-cpu-strict-batch --cpu-strict-batch-draft --spec-draft-prio-batch "
      "--prio-batch-draft --spec-draft-poll-batch --poll-batch-draft", "N", "ignored", SCHEDULING),
    S("--spec-draft-override-tensor -otd --override-tensor-draft "
      "--spec-draft-n-cpu-moe --spec-draft-ncmoe -ncmoed --n-cpu-moe-draft --spec-ngram-mod-n-min "
      "--spec-ngram-mod-n-match --spec-ngram-simple-size-n --spec-ngram-simple-size-m "
      "--spec-ngram-simple-min-hits --spec-ngram-map-k-size-n --spec-ngram-map-k-size-m --spec-ngram-map-k-min-hits "
      "--spec-ngram-map-k4v-size-n --spec-ngram-map-k4v-size-m --spec-ngram-map-k4v-min-hits --spec-ngram-size-n "
      "--spec-ngram-size-m --spec-ngram-min-hits", "VALUE", "ignored",
      "settings of llama.cpp's draft model and n-gram drafts that change nothing here"),
    S("--spec-draft-cpu-moe -cmoed --cpu-moe-draft --spec-draft-backend-sampling --no-spec-draft-backend-sampling",
      None, "ignored", "settings of llama.cpp's draft model that change nothing here"),
    S("--spec-default", None, "server", "llama.cpp's default speculative decoding (n-gram drafts): mode ngram",
      "spec_default"),
    S("--image-min-tokens --image-max-tokens --mtmd-batch-max-tokens --video-fps --video-timestamp-interval "
      "--video-ffmpeg-dir", "VALUE", "ignored", "text only: no projector is ever loaded"),
    S("--embd-gemma-default --fim-qwen-1.5b-default --fim-qwen-3b-default --fim-qwen-7b-default --fim-qwen-7b-spec "
      "--fim-qwen-14b-spec --fim-qwen-30b-default --gpt-oss-20b-default --gpt-oss-120b-default "
      "--vision-gemma-4b-default --vision-gemma-12b-default", None, "refused", NO_DOWNLOAD),
    S("--version", None, "server", "print the version and exit", "version"),
    S("--usage", None, "refused", "see --help"),
    S("-cl --cache-list", None, "refused", "there is no model cache: " + NO_DOWNLOAD),
    S("--completion-bash", None, "refused", "no shell completion script"),
    S("--list-devices", None, "refused", "llama-cli --list-devices (this package's) lists them"),
    S("-lcs --lookup-cache-static -lcd --lookup-cache-dynamic", "FNAME", "refused",
      "n-gram lookup here learns from the server's own requests (--ngram-cache)"),
]

USES = ("sampling", "server", "ignored", "refused")


def flag_name(row: LlamaFlag) -> str:
    """A row's attribute on the parsed args."""
    return "llama_" + row.flags[-1].lstrip("-").replace("-", "_")


class Given(argparse.Action):
    """Keeps which spelling was given with its value: (flag, value or None for a switch); the last one wins."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, (option_string, values if isinstance(values, str) else None))


def add_llama_flags(parser: argparse.ArgumentParser) -> None:
    """The table's flags on `parser`, in a group of their own; a spelling the parser already has is left to it (the
    server's own flags, and chat-template flags where the server defines them)."""
    group = parser.add_argument_group("llama-server's flags", "accepted so that llama-server's command lines run "
                                      "unchanged: honoured, ignored where they change nothing here, or refused")
    taken = set(parser._option_string_actions)
    for row in LLAMA_FLAGS:
        flags = [f for f in row.flags if f not in taken]
        if not flags:
            continue
        note = {"sampling": "", "server": "", "ignored": "ignored: ", "refused": "refused: "}[row.use]
        if row.use == "refused" and row.neutral:
            note = f"refused unless {' or '.join(row.neutral)}: "
        group.add_argument(*flags, dest=flag_name(row), action=Given, nargs=0 if row.hint is None else None,
                           metavar=None if row.hint is None else row.hint.replace("%", "%%"),
                           help=(note + row.why).replace("%", "%%"), default=None)
        taken.update(flags)


def same_value(given: str, neutral: str) -> bool:
    """A value equal to a neutral one, as a number where both are numbers."""
    try:
        return float(given) == float(neutral)
    except ValueError:
        return given == neutral


def llama_flags_of(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[dict[str, Any], dict[str, Any]]:
    """The table's flags given: (sampling defaults as GenerateOptions' fields, the server's settings by dest). A
    refused flag (with a value that is not neutral) ends the start with a message naming it."""
    sampling: dict[str, Any] = {}
    server: dict[str, Any] = {}
    for row in LLAMA_FLAGS:
        given = getattr(args, flag_name(row), None)
        if given is None:
            continue
        flag, value = given
        if row.use == "refused":
            if value is None or not any(same_value(value, n) for n in row.neutral):
                parser.error(f"{flag if value is None else f'{flag} {value}'}: not supported by specee-server: "
                             f"{row.why}")
        elif row.use == "sampling":
            assert row.dest is not None  # every sampling and server row names its field
            if value is None:
                sampling[row.dest] = True
                continue
            kind = GENERATION_OPTIONS[row.dest]["type"]
            try:
                sampling[row.dest] = (value if kind in (_TEXT, _FLOATS) else float(value) if kind == _FLOAT
                                      else int(value))
            except ValueError:
                parser.error(f"{flag}: expected a number, not {value!r}")
        elif row.use == "server":
            assert row.dest is not None
            server[row.dest] = flag if value is None else value
    return sampling, server
