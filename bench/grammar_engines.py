"""Measure the two constraint engines on this machine: llguidance and xgrammar.

    python -m bench.grammar_engines [-m MODEL.gguf] [--generator RUNS]

For each engine and grammar: the time to compile it for SmolLM2's 49,152-token vocabulary (built from the GGUF's
own vocabulary, as the runtime builds it), and the time of one token mask along a walk of N tokens that the grammar
allows; and which grammar kinds it accepts. Prints one table (docs/structured-output.md).
"""

import argparse
import json
import statistics
import time

import numpy as np

JSON_SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer",
               "minimum": 0, "maximum": 150}}, "required": ["name", "age"]},
    "nested+enum": {"type": "object", "properties": {
        "order": {"type": "object", "properties": {"id": {"type": "integer"},
                  "status": {"enum": ["new", "paid", "shipped"]},
                  "items": {"type": "array", "items": {"type": "object", "properties": {
                      "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer"}},
                      "required": ["sku", "qty"]}, "minItems": 1, "maxItems": 5}},
                  "required": ["id", "status", "items"]}}, "required": ["order"]},
    "anyOf": {"anyOf": [{"type": "object", "properties": {"ok": {"const": True}, "value": {"type": "number"}},
                         "required": ["ok", "value"]},
                        {"type": "object", "properties": {"ok": {"const": False}, "error": {"type": "string"}},
                         "required": ["ok", "error"]}]},
}

GBNF_ARITHMETIC = r"""
root  ::= expr
expr  ::= term (("+" | "-") term)*
term  ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""

LARK_LIST = r"""
start: item+
item: "- " /[a-z]+/ "\n"
"""

REGEX = r"[0-9]{3}-[0-9]{4}"

# a valid output of each grammar: the walk the masks are timed along (JSON compact: llguidance's default)
OUTPUTS = {
    "json:person": '{"name":"Ada Lovelace","age":36}',
    "json:nested+enum": '{"order":{"id":17,"status":"paid","items":[{"sku":"ABC-1234","qty":2},'
                        '{"sku":"XYZ-0001","qty":1}]}}',
    "json:anyOf": '{"ok":false,"error":"the disk is full"}',
    "gbnf:arithmetic": "12+(3*45)-6/2",
    "lark:list": "- apple\n- pear\n- plum\n",
    "regex:phone": "555-1234",
}


def gguf_vocab(path: str):
    """The token bytes of a GGUF's vocabulary (GPT-2 byte-level pieces mapped back to bytes), its EOS, the ids of
    its end-of-generation tokens, each output of OUTPUTS tokenized (EOS appended) and the model's tokenizer."""
    from specee import Model
    m = Model(path, n_ctx=64)
    toks = [m.token_to_piece(t, special=True) for t in range(m.n_vocab)]
    eos = m.eog_tokens[0]
    walks = {k: m.tokenize(v) + [eos] for k, v in OUTPUTS.items()}
    return toks, eos, m.eog_tokens, walks, lambda b: m.tokenize(b, add_special=False)


def walk(ids: list[int], mask_of, consume) -> list[float]:
    """A mask before each token of a valid output, then the token consumed; per-mask times in ms."""
    times = []
    for tok in ids:
        t0 = time.perf_counter()
        mask = mask_of()
        times.append((time.perf_counter() - t0) * 1e3)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
        assert bits[tok], f"token {tok} refused by the mask on a valid output"
        consume(tok)
    return times


def bench_llguidance(tokens, eos, specials, grammars, n, tokenize):
    import llguidance as llg

    class Tok:
        eos_token_id = eos
        bos_token_id = None
        special_token_ids = specials
        def __init__(self):
            self.tokens = tokens
        def __call__(self, b):  # the model's own tokenizer (llguidance needs it to judge token boundaries)
            return tokenize(b)

    t0 = time.perf_counter()
    tok = llg.LLTokenizer(llg.TokenizerWrapper(Tok()))
    t_tok = (time.perf_counter() - t0) * 1e3
    rows = []
    for name, (kind, text) in grammars.items():
        if kind == "json":
            g = llg.LLMatcher.grammar_from_json_schema(json.dumps(text))
        elif kind in ("gbnf", "lark"):  # its Lark reader takes GBNF's `::=` rules too (as the C API does)
            g = llg.LLMatcher.grammar_from_lark(text)
        else:
            g = llg.LLMatcher.grammar_from_regex(text)
        t0 = time.perf_counter()
        m = llg.LLMatcher(tok, g)
        t_compile = (time.perf_counter() - t0) * 1e3
        if m.is_error():
            rows.append((name, "error: " + m.get_error(), None, None))
            continue

        def mask_of():
            return np.frombuffer(m.compute_bitmask(), dtype=np.uint32)

        times = walk(n[name], mask_of, m.consume_token)
        rows.append((name, t_compile, statistics.median(times), max(times)))
    return t_tok, rows


def bench_xgrammar(tokens, eos, specials, grammars, n, tokenize):
    import torch
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(tokens, vocab_type=xgr.VocabType.RAW, vocab_size=len(tokens), stop_token_ids=[eos])
    comp = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    t_tok = (time.perf_counter() - t0) * 1e3
    rows = []
    for name, (kind, text) in grammars.items():
        t0 = time.perf_counter()
        try:
            if kind == "json":
                cg = comp.compile_json_schema(json.dumps(text))
            elif kind == "gbnf":
                cg = comp.compile_grammar(text)
            elif kind == "regex":
                cg = comp.compile_regex(text)
            else:
                raise ValueError("xgrammar takes no Lark grammars")
        except Exception as e:  # the engine's own refusal is the figure here
            rows.append((name, "error: " + str(e).splitlines()[0][:60], None, None))
            continue
        t_compile = (time.perf_counter() - t0) * 1e3
        m = xgr.GrammarMatcher(cg)
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)

        def mask_of():
            m.fill_next_token_bitmask(bitmask)
            return bitmask[0].numpy()

        times = walk(n[name], mask_of, m.accept_token)
        rows.append((name, t_compile, statistics.median(times), max(times)))
    return t_tok, rows


def bench_generator(model_path: str, n_runs: int) -> None:
    """The mask's cost inside the runtime's generator: sampling time per token (mask, draw, advance) with and without
    a grammar beside the decode step's, greedy, plain mode, on the same prompts."""
    from specee import Model
    m = Model(model_path, n_ctx=1024)
    prompt = [{"role": "user", "content": "Describe a fictional order in a shop as JSON."}]
    cases = [("none", {}), ("json {}", {"json_schema": {}}),
             ("json:nested+enum", {"json_schema": JSON_SCHEMAS["nested+enum"]}),
             ("gbnf:arithmetic", {"grammar": GBNF_ARITHMETIC})]
    print(f"{'grammar':<18} {'tokens':>7} {'decode ms/token':>16} {'sample ms/token':>16}")
    for name, opts in cases:
        n = dec = smp = 0.0
        for _ in range(n_runs):
            m.generate(prompt, 64, temp=0, mode="plain", **opts)
            st = m.last_stats
            n, dec, smp = n + st.n_decoded, dec + st.t_decode_ms, smp + st.t_sample_ms
        print(f"{name:<18} {int(n):>7} {dec / n:>16.2f} {smp / n:>16.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--generator", type=int, default=0, metavar="RUNS",
                    help="also time sampling with and without a grammar inside the generator, RUNS runs each")
    args = ap.parse_args()
    from specee.paths import default_model_path
    tokens, eos, specials, walks, tokenize = gguf_vocab(args.model or default_model_path())
    grammars = {f"json:{k}": ("json", v) for k, v in JSON_SCHEMAS.items()}
    grammars["gbnf:arithmetic"] = ("gbnf", GBNF_ARITHMETIC)
    grammars["lark:list"] = ("lark", LARK_LIST)
    grammars["regex:phone"] = ("regex", REGEX)
    print(f"vocabulary: {len(tokens)} tokens; masks timed along a valid output of each grammar "
          f"({min(map(len, walks.values()))}-{max(map(len, walks.values()))} tokens)")
    print(f"{'engine':<11} {'grammar':<18} {'compile ms':>12} {'mask ms (median)':>17} {'mask ms (max)':>14}")
    for engine, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        t_tok, rows = fn(tokens, eos, specials, grammars, walks, tokenize)
        print(f"{engine:<11} {'(tokenizer)':<18} {t_tok:>12.1f}")
        for name, tc, med, mx in rows:
            if isinstance(tc, str):
                print(f"{engine:<11} {name:<18} {tc}")
            else:
                print(f"{engine:<11} {name:<18} {tc:>12.1f} {med:>17.3f} {mx:>14.3f}")
    if args.generator:
        bench_generator(args.model or default_model_path(), args.generator)


if __name__ == "__main__":
    main()
