"""llama.cpp's /infill: fill in the middle of code. The request gives the text before and after the gap (`input_prefix`,
`input_suffix`), optionally other files of the project (`input_extra`: [{filename, text}]) and the start of the
middle (`prompt`); the server lays them out with the model's FIM tokens (csrc/include/specee.h) as llama-server 0.3.36
does, and answers as /completion does (every /completion field, streamed or whole).

The layout (repository-level FIM, as Qwen2.5-Coder was trained on), each part present only where the vocabulary
has its token:

    [rep]myproject\\n [sep]FILENAME\\n TEXT ... [sep]filename\\n [bos] [pre]PREFIX PROMPT [suf]SUFFIX [mid]

(without a file separator token each extra file is introduced by the plain text "\\n\\n--- snippet ---\\n\\n"; with
--spm-infill the suffix part comes before the prefix part). The context is shared as llama-server shares it: the
last 3/4 of a batch (-b) of the prefix, the first 1/4 of a batch (less the prompt and two tokens) of the suffix, and
of the extra files' tokens the last ones that fit in the slot's context less a batch and twice the server's -n.

Only what can fit is tokenized: the prefix's end, the suffix's start and the extra files from the last one back,
each text cut to MAX_TOKEN_CHARS characters per token that can still fit (plus CUT_SLACK) before it is tokenized, so
a 4 MB `input_extra` costs the context's tokens, not seconds of tokenizing (it took 5 s before). The tokens kept are
those of the whole text wherever no token is longer than MAX_TOKEN_CHARS characters.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from specee.model import Model
from specee.server.engine import ServerState
from specee.server.llama import llama_answer
from specee.server.request import ApiError, json_object, off_loop, shown

# the kinds a prompt needs (specee.h's FIM names) and how an error names them
NEEDED = {"pre": "prefix", "suf": "suffix", "mid": "middle"}
REPO_NAME = "myproject"  # the repository's name after the rep token (llama-server's)
FILE_NAME = "filename"  # the name of the file being filled in, after the last sep token (llama-server's)
EXTRA_FILE_NAME = "tmp"  # an extra file's name when it gives none (llama-server's)
SNIPPET = "\n\n--- snippet ---\n\n"  # before each extra file, without a sep token
MAX_TOKEN_CHARS = 64  # characters one token is taken to cover at most, where text is cut before tokenizing
CUT_SLACK = 1024  # characters kept beyond that, so the cut is far from the tokens kept


def check_fim(model: Model) -> dict[str, int]:
    """The model's FIM tokens; 501 naming the missing ones when it cannot fill in (no prefix, suffix or middle)."""
    fim = model.fim_tokens
    missing = [what for kind, what in NEEDED.items() if fim[kind] < 0]
    if missing:
        names = " or ".join(missing) if len(missing) < 3 else f"{missing[0]}, {missing[1]} or {missing[2]}"
        raise ApiError(501, f"infill is not supported by this model: its vocabulary has no FIM {names} token "
                       "(tokenizer.ggml.fim_pre_token_id / fim_suf_token_id / fim_mid_token_id, or a token such as "
                       "<|fim_prefix|>, <fim_suffix>, <MID>)", "not_supported_error")
    return fim


def cut_tokens(model: Model, text: str, n: int, from_end: bool) -> list[int]:
    """The last (from_end) or first n tokens of text's plain tokens, only the text that can hold them tokenized."""
    keep = n * MAX_TOKEN_CHARS + CUT_SLACK
    if len(text) > keep:
        text = text[len(text) - keep:] if from_end else text[:keep]
    ids = model.tokenize(text, add_special=False) if n > 0 else []
    return ids[max(0, len(ids) - n):] if from_end else ids[:n]


def text_tokens(model: Model, value: Any, key: str, n: int, from_end: bool) -> list[int]:
    """`input_prefix` / `input_suffix`: a string, or a list of token ids and strings (llama.cpp's mixed prompt), as
    token ids, the last (from_end) or first n of them; text is tokenized as plain text (special tokens' text stays
    text), without BOS, only as much of it as those n need."""
    if isinstance(value, str):
        return cut_tokens(model, value, n, from_end)
    if isinstance(value, list) and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in value):
        if not all(0 <= p < model.n_vocab for p in value if isinstance(p, int)):
            raise ApiError(400, f"token ids of '{key}' must be in [0, {model.n_vocab})", param=key)
        tokens: list[int] = []
        for p in reversed(value) if from_end else value:
            if len(tokens) >= n:
                break
            part = cut_tokens(model, p, n - len(tokens), from_end) if isinstance(p, str) else [p]
            tokens = [*part, *tokens] if from_end else [*tokens, *part]
        return tokens
    raise ApiError(400, f"'{key}' must be a string or a list of token ids and strings, not {shown(value)}", param=key)


def extra_files(body: dict) -> list[tuple[str, str]]:
    """`input_extra` checked: [(filename, text)] (a file without a name is named "tmp")."""
    extra = body.get("input_extra")
    if extra is None:
        return []
    if not isinstance(extra, list):
        raise ApiError(400, "'input_extra' must be a list of {\"filename\": string, \"text\": string}, not "
                       f"{shown(extra)}", param="input_extra")
    files = []
    for i, chunk in enumerate(extra):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise ApiError(400, f"'input_extra'[{i}] must have a \"text\" field holding a string", param="input_extra")
        name = chunk.get("filename", EXTRA_FILE_NAME)
        if not isinstance(name, str):
            raise ApiError(400, f"'input_extra'[{i}]: \"filename\" must be a string, not {shown(name)}",
                           param="input_extra")
        files.append((name, chunk["text"]))
    return files


def infill_prompt(model: Model, prefix: list[int], suffix: list[int], extra: list[tuple[str, str]],
                  prompt: list[int], n_batch: int, n_predict: int, n_ctx: int, spm: bool = False) -> list[int]:
    """The prompt's token ids (the layout in this module's docstring): `prefix`, `suffix` and `prompt` as token ids,
    `extra` the other files; n_batch: the server's logical batch (-b), n_predict: its -n (-1: none), n_ctx: a slot's
    context; spm: the suffix part first (--spm-infill)."""
    fim = check_fim(model)

    def plain(text: str) -> list[int]:
        return model.tokenize(text, add_special=False)

    # the context's parts from its end back, until they fill what it may take (the rest could not fit)
    budget = max(0, n_ctx - n_batch - 2 * n_predict)
    parts = [[fim["sep"], *plain(FILE_NAME + "\n")]] if fim["sep"] >= 0 else []
    n_have = sum(map(len, parts))
    for name, text in reversed(extra):
        if n_have >= budget:
            break
        text_ids = cut_tokens(model, text, budget - n_have, from_end=True)
        parts.append([*([fim["sep"], *plain(name + "\n")] if fim["sep"] >= 0 else plain(SNIPPET)), *text_ids])
        n_have += len(parts[-1])
    if fim["rep"] >= 0 and n_have < budget:
        parts.append([fim["rep"], *plain(REPO_NAME + "\n")])
    context = [t for part in reversed(parts) for t in part]
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_context = min(budget, len(context))
    before = [fim["pre"], *prefix[len(prefix) - n_prefix:], *prompt]
    after = [fim["suf"], *suffix[:n_suffix]]
    if spm:
        before, after = after, before
    bos = [model.bos] if model.bos >= 0 and model.tokenize("", add_special=True)[:1] == [model.bos] else []
    return [*context[len(context) - n_context:], *bos, *before, *after, fim["mid"]]


def infill_tokens(state: ServerState, body: dict) -> list[int]:
    """A request body's prompt (400 on a bad field), laid out for the server's model and settings."""
    model = state.model
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise ApiError(400, f"'prompt' must be a string (the start of the middle), not {shown(prompt)}",
                       param="prompt")
    for key in ("input_prefix", "input_suffix"):
        if key not in body:
            raise ApiError(400, f"'{key}' is required", param=key)
    n_batch = state.n_batch
    prefix = text_tokens(model, body["input_prefix"], "input_prefix", 3 * (n_batch // 4), from_end=True)
    suffix = text_tokens(model, body["input_suffix"], "input_suffix", n_batch // 4, from_end=False)
    extra = extra_files(body)
    if len(prompt) > state.engine.n_ctx_slot * MAX_TOKEN_CHARS:  # more tokens than a slot holds, surely
        raise ApiError(400, f"'prompt' is {len(prompt)} characters: more tokens than a slot's context "
                       f"({state.engine.n_ctx_slot})", param="prompt")
    try:
        prompt_ids = model.tokenize(prompt, add_special=False, parse_special=True)
    except ValueError as e:  # a lone surrogate (check_json refuses them first)
        raise ApiError(400, f"'prompt': {e}", param="prompt") from None
    return infill_prompt(model, prefix, suffix, extra, prompt_ids, n_batch, state.n_predict,
                         state.engine.n_ctx_slot, state.spm_infill)


async def infill(request: Request) -> Response:
    """POST /infill: {input_prefix, input_suffix, input_extra?, prompt?, ...every /completion field} -> /completion's
    answer (its `prompt`: the laid-out prompt's text, special tokens' text included)."""
    state: ServerState = request.app.state.server
    check_fim(state.model)  # before the body, as llama-server
    body = await json_object(request)
    tokens = await off_loop(request, infill_tokens, state, body)
    return await llama_answer(state, request, body, [tokens])
