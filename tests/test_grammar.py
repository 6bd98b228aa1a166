"""Structured output (csrc/decode/specee-grammar.cpp, docs/structured-output.md): every output under a JSON Schema
validates (jsonschema) over 52 schemas, greedy and sampled, on SmolLM2; GBNF grammars in llama.cpp's grammars/ style are
accepted and bind the output, malformed ones are refused with the line and the reason; the lossless modes (eagle,
eagle2, ngram) under a grammar give what plain decoding under it gives, early exit stays inside it, tree exit and
checked exits refuse it; the CLI's and the server's spellings (response_format, the openai client's parse with a
pydantic model, llama.cpp's grammar / json_schema fields), and a malformed grammar is a 400 after which the server
keeps serving. Servers bind 127.0.0.1, are stopped by their fixture, and every loop is bounded."""

from __future__ import annotations

import json
import re
import subprocess
from decimal import Decimal
from pathlib import Path
from typing import Iterator, Literal

import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from specee import Model, SpecEEError, _core
from specee._tools import tool_path
from specee.generate import EagleParams, ExitParams, GenerateOptions, NgramParams
from test_server import TIMEOUT, Server, call

# ---- grammars -------------------------------------------------------------------------------------------

GBNF_ARITHMETIC = r"""
# an expression of integers (llama.cpp's grammars/arithmetic.gbnf in spirit)
root   ::= expr
expr   ::= term ([-+*/] term){0,3}
term   ::= num | "(" expr ")"
num    ::= [1-9] [0-9]{0,2}
"""
ARITHMETIC_RE = r"[-+*/()0-9]+"

GBNF_LIST = r"""
root ::= item{1,4}
item ::= "- " [a-z]{1,12} "\n"
"""
LIST_RE = r"(- [a-z]{1,12}\n){1,4}"

GBNF_JSON = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null")
object ::=
  "{" (
    string ":" value
    ("," string ":" value){0,3}
  )? "}"
array  ::= "[" (value ("," value){0,3})? "]"
string ::= "\"" ([^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})){0,16} "\""
number ::= "-"? ([0-9] | [1-9] [0-9]{0,5}) ("." [0-9]{1,4})?
"""

MALFORMED_GBNF = [
    ("root ::= (", "line 1: a '(' without its ')'"),
    ("root ::= foo", "rule 'foo' is used but not defined"),
    ('expr ::= "a"', "no rule named root"),
    ('root ::= "abc', "line 1: a string without its closing quote"),
    ("root ::= [a-z", "line 1: a character class without its closing ]"),
    ('root ::= "a"{2', "a repetition {m,n} without its closing }"),
    ('root = "a"', "'::=' expected after the rule name 'root'"),
    ('root ::= "a"\nroot ::= "b"', "line 2: rule 'root' is defined twice"),
    ('root ::= "a" )', "a ')' without its '('"),
    ('root ::= "\\q"', "unknown escape in a string"),
    ("", "empty grammar"),
]


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


NAME = {"type": "string", "minLength": 1, "maxLength": 16}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}

# 52 schemas: nesting, enums, arrays with bounds, anyOf, required/optional, patterns, number ranges (numbers with a
# multipleOf: without one a small model can write decimals until max_tokens, docs/structured-output.md)
SCHEMAS: list[dict] = [
    obj({"name": NAME}),
    obj({"name": NAME, "age": AGE}),
    obj({"name": NAME, "age": AGE}, required=["name"]),
    obj({"name": NAME, "age": AGE}, required=[]),
    obj({"ok": {"type": "boolean"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"size": {"enum": ["S", "M", "L", "XL"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}),
    obj({"status": {"const": "done"}}),
    obj({"level": {"enum": [1, 2, 3]}}),
    obj({"answer": {"enum": ["yes", "no", None]}}),
    obj({"score": {"type": "integer", "minimum": -5, "maximum": 5}}),
    obj({"year": {"type": "integer", "minimum": 1900, "maximum": 2100}}),
    obj({"temp": {"type": "number", "minimum": -50, "maximum": 50, "multipleOf": 0.5}}),
    obj({"p": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01}}),
    obj({"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000, "multipleOf": 0.01}}),
    obj({"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}),
    obj({"sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
    obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "city": NAME}),
    obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    obj({"word": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 10}}),
    obj({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}),
    obj({"tags": {"type": "array", "items": NAME, "maxItems": 2}}),
    obj({"nums": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2,
                  "maxItems": 4}}),
    obj({"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3}}),
    obj({"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}}),
    obj({"pair": {"type": "array", "prefixItems": [NAME, AGE], "items": False, "minItems": 2}}),
    obj({"person": obj({"name": NAME, "age": AGE})}),
    obj({"person": obj({"name": NAME, "address": obj({"city": NAME, "zip": {"type": "string",
                                                                           "pattern": "^[0-9]{5}$"}})})}),
    obj({"a": obj({"b": obj({"c": {"type": "integer", "minimum": 0, "maximum": 9}})})}),
    obj({"people": {"type": "array", "items": obj({"name": NAME, "age": AGE}), "minItems": 1, "maxItems": 2}}),
    obj({"order": obj({"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                       "status": {"enum": ["new", "paid", "shipped"]},
                       "items": {"type": "array", "items": obj({"sku": {"type": "string",
                                                                        "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                                                "qty": {"type": "integer", "minimum": 1,
                                                                        "maximum": 5}}),
                                 "minItems": 1, "maxItems": 2}})}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9},
                                               "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}),
    {"anyOf": [obj({"ok": {"const": True}, "value": AGE}), obj({"ok": {"const": False}, "error": NAME})]},
    obj({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, {"type": "string",
                                                                              "pattern": "^[a-z]{4}$"}]}}),
    obj({"value": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}),
    obj({"shape": {"anyOf": [obj({"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1,
                                                                      "maximum": 9}}),
                             obj({"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                                        "maximum": 9}})]}}),
    {"oneOf": [obj({"cat": NAME}), obj({"dog": NAME})]},
    obj({"name": NAME, "nick": {"anyOf": [NAME, {"type": "null"}]}}),
    obj({"title": {"type": "string", "maxLength": 24}, "done": {"type": "boolean"},
         "priority": {"enum": ["low", "high"]}}),
    obj({"first": NAME, "last": NAME, "age": AGE, "email": {"type": "string",
                                                           "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}),
    obj({"lat": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.001},
         "lon": {"type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.001}}),
    obj({"rgb": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}, "minItems": 3,
                 "maxItems": 3}}),
    obj({"steps": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
         "count": {"type": "integer", "minimum": 1, "maximum": 3}}),
    obj({"meta": obj({"version": {"type": "string", "pattern": "^[0-9]\\.[0-9]$"}, "stable": {"type": "boolean"}},
                     required=["version"])}),
    obj({"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9},
         "z": {"type": "integer", "minimum": 0, "maximum": 9}}, required=["x"]),
    {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": obj({"k": NAME, "v": AGE}), "maxItems": 2},
    {"type": "string", "pattern": "^[A-Z][a-z]{2,8}$"},
    {"type": "integer", "minimum": 10, "maximum": 99},
    {"enum": ["alpha", "beta", "gamma"]},
]
assert len(SCHEMAS) == 52

PROMPTS = [
    "Answer with JSON only. Describe a fictional person who lives in Paris.",
    "Output a small JSON value for a shop's database about a blue shirt.",
    "Give me JSON data about the weather in Oslo today.",
]


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(n_ctx=1024)


@pytest.fixture(scope="module")
def model_head() -> Model:
    """SmolLM2 with its shipped draft head and exit predictors (eagle, eagle2, early-exit)."""
    return Model(n_ctx=1024, draft_head="default")


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def check_json(text: str, schema: dict) -> None:
    """The text validates against the schema, its numbers (and the schema's) read as decimals: `multipleOf: 0.001`
    holds for 46.233 as written, which binary floats would refuse (46.233 / 0.001 = 46232.999...)."""
    jsonschema.validate(json.loads(text, parse_float=Decimal), json.loads(json.dumps(schema), parse_float=Decimal))


# ---- GBNF -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("grammar,pattern", [(GBNF_ARITHMETIC, ARITHMETIC_RE), (GBNF_LIST, LIST_RE),
                                             (GBNF_JSON, None)], ids=["arithmetic", "list", "json"])
def test_gbnf_grammars_bind_the_output(model: Model, grammar: str, pattern: str | None) -> None:
    for prompt in ("Compute something: ", "Write a shopping list:\n"):
        out = model.generate(prompt, 96, temp=0, mode="plain", grammar=grammar)
        assert model.last_stats.stop_reason == "eog", out  # the grammar ended the output
        if pattern is None:
            json.loads(out)
        else:
            assert re.fullmatch(pattern, out), out


@pytest.mark.parametrize("grammar,message", MALFORMED_GBNF)
def test_malformed_gbnf_is_refused_with_its_reason(model: Model, grammar: str, message: str) -> None:
    with pytest.raises(SpecEEError, match=re.escape(message)):
        model.generate("x", 4, grammar=grammar)


@pytest.mark.parametrize("kind,text,message", [
    ("json_schema", '{"type": "objekt"}', "json_schema: "),
    ("json_schema", "{not json", "json_schema: "),
    ("lark", "start: foo", "lark: "),
    ("regex", "(ab", "regex: "),
])
def test_engine_refusals_carry_its_message(model: Model, kind: str, text: str, message: str) -> None:
    opts = {"json_schema": text} if kind == "json_schema" else {"grammar": text, "grammar_type": kind}
    if kind == "json_schema" and text.startswith("{not"):
        with pytest.raises(ValueError, match="json_schema: not JSON"):  # Python finds this one first
            model.generate("x", 4, **opts)
        return
    with pytest.raises(SpecEEError, match=re.escape(message)):
        model.generate("x", 4, **opts)


def test_lark_and_regex_grammars(model: Model) -> None:
    out = model.generate("Phone: ", 20, temp=0, mode="plain", grammar=r"[0-9]{3}-[0-9]{4}", grammar_type="regex")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out)
    out = model.generate("Say yes or no: ", 20, temp=0, mode="plain", grammar='start: "yes" | "no"',
                         grammar_type="lark")
    assert out in ("yes", "no")


def test_options_take_one_grammar(model: Model) -> None:
    with pytest.raises(ValueError, match="grammar or json_schema, not both"):
        GenerateOptions(grammar="root ::= \"a\"", json_schema={})
    with pytest.raises(SpecEEError, match="grammar_type regex without a grammar"):
        model.generate("x", 4, grammar_type="regex")
    with pytest.raises(ValueError, match="a dict, a JSON string or a pydantic model class"):
        model.generate("x", 4, json_schema=3)


# ---- the constraint interface -------------------------------------------------------------------------


def allowed(mask, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def test_constraint_interface_mask_accept_rollback_forced(model: Model) -> None:
    """specee_grammar_*: the mask allows a valid output's next token and refuses others, accept advances, rollback
    gives back the earlier state's mask, forced gives the tokens of a key, the end is allowed once the value is
    complete."""
    schema = json.dumps(obj({"name": NAME}))
    g = _core.Grammar(model._model, _core.GRAMMAR_JSON_SCHEMA, schema)
    ids = model.tokenize('{"name":"Ada"}', add_special=False)
    start = g.mask()
    assert len(start) == (model.n_vocab + 31) // 32
    eos = model.eog_tokens[0]
    assert not allowed(start, eos) and not allowed(start, model.tokenize("x", add_special=False)[0])
    masks = []
    for t in ids:
        masks.append(g.mask().copy())
        assert allowed(masks[-1], t)
        g.accept(t)
    assert allowed(g.mask(), eos)  # the value is complete: the end is allowed
    g.rollback(len(ids) - 1)
    assert (g.mask() == masks[1]).all()
    with pytest.raises(SpecEEError, match="is not allowed here by the grammar"):
        g.accept(eos)
    g.rollback(1)
    assert (g.mask() == start).all()
    g.accept(ids[0])  # '{"' (llguidance allows canonical tokens only: '{' alone is refused here)
    forced = g.forced(8)  # the only key is "name"
    assert forced and model.detokenize([ids[0]] + forced).startswith('{"name')
    with pytest.raises(SpecEEError, match="rollback"):
        g.rollback(5)


def mask_walk(g: _core.Grammar, tokens: list[int]) -> int:
    """How many of tokens the mask allows one after another (accepting them), the grammar left as it was."""
    n = 0
    while n < len(tokens) and allowed(g.mask(), tokens[n]):
        g.accept(tokens[n])
        n += 1
    g.rollback(n)
    return n


def test_valid_prefix_agrees_with_the_masks(model: Model) -> None:
    """specee_grammar_valid_prefix (how the generator judges drafts before verifying them) counts what the masks
    allow token by token, from several states, for valid outputs and outputs broken at each position, and leaves the
    state as it was (the mask after equals the mask before)."""
    schema = SCHEMAS[1]
    g = _core.Grammar(model._model, _core.GRAMMAR_JSON_SCHEMA, json.dumps(schema))
    good = model.tokenize('{"name":"Ada","age":36}', add_special=False)
    eos = model.eog_tokens[0]
    wrong = model.tokenize("x", add_special=False)[0]
    cases = [good, good + [eos], good[:3] + [eos], [wrong] + good]
    cases += [good[:k] + [wrong] + good[k:] for k in range(1, len(good), 2)]
    counts = set()
    for start in (0, 1, 3):
        for t in good[:start]:
            g.accept(t)
        before = g.mask().copy()
        for tokens in cases:
            tokens = tokens[start:] if start and tokens[:start] == good[:start] else tokens
            n = g.valid_prefix(tokens)
            assert n == mask_walk(g, tokens), (start, tokens)
            counts.add(n)
            assert (g.mask() == before).all()
        g.rollback(start)
    assert len(counts) > 3  # the cases stop at different places
    assert g.valid_prefix([]) == 0


# ---- JSON schemas ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_every_output_validates(model: Model, i: int) -> None:
    """Each schema: two prompts greedy, one sampled (a seed per schema); every output ends and validates."""
    schema = SCHEMAS[i]
    runs = [(PROMPTS[i % 3], {"temp": 0}), (PROMPTS[(i + 1) % 3], {"temp": 0}),
            (PROMPTS[(i + 2) % 3], {"temp": 0.8, "seed": 1000 + i})]
    for prompt, sampling in runs:
        out = model.generate(chat(prompt), 160, mode="plain", json_schema=schema, **sampling)
        assert model.last_stats.stop_reason == "eog", (prompt, sampling, out)
        check_json(out, schema)


@pytest.mark.slow
def test_pydantic_model_class(model: Model) -> None:
    class City(BaseModel):
        name: str = Field(max_length=20)
        country: Literal["France", "Norway", "Japan"]
        population_millions: int = Field(ge=0, le=50)

    out = model.generate(chat("Describe Paris as JSON."), 100, temp=0, mode="plain", json_schema=City)
    City.model_validate_json(out)


# ---- speculative modes under a grammar ------------------------------------------------------------------

SPEC_CASES = [("json_schema", SCHEMAS[1]), ("json_schema", SCHEMAS[34]), ("grammar", GBNF_LIST)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eagle", "eagle2", "ngram"])
def test_lossless_modes_equal_plain_under_a_grammar(model_head: Model, mode: str) -> None:
    for (kind, g), prompt in zip(SPEC_CASES, PROMPTS):
        plain = model_head.generate(chat(prompt), 100, temp=0, mode="plain", jump_forward=False, **{kind: g})
        spec = model_head.generate(chat(prompt), 100, temp=0, mode=mode, **{kind: g})
        assert model_head.last_stats.mode == mode
        assert spec == plain, (mode, prompt)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eagle2", "ngram"])
def test_drafts_the_grammar_refuses_never_reach_verification(model_head: Model, mode: str) -> None:
    """The draft head, and lookup (the prompt repeats an object whose next key, "id", the schema refuses after
    "name"), propose tokens the grammar refuses: the head's are skipped while its tree is drafted, the next allowed
    candidate taken instead (n_grammar_masked), lookup's chains are cut before the pass (n_grammar_dropped); no
    refused token gets a row, and the output is plain decoding's under the same grammar."""
    schema = obj({"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}})
    prompt = chat('Reply with {"name":"x","id":1} {"name":"x","id":1} {"name":"x","id":1} as JSON.')
    # lookup drafts wherever the sequence's end was seen before (not only where its acceptance so far says it pays)
    extra = {"ngram": NgramParams(adaptive=False)} if mode == "ngram" else {}
    plain = model_head.generate(prompt, 60, temp=0, mode="plain", jump_forward=False, json_schema=schema)
    model_head.ngram_cache_clear()  # plain's output joined the cross-request store: lookup would copy it, all allowed
    spec = model_head.generate(prompt, 60, temp=0, mode=mode, json_schema=schema, **extra)
    st = model_head.last_stats
    assert spec == plain
    if mode == "eagle2":
        assert st.n_grammar_masked > 0 and st.n_grammar_dropped == 0, st
    else:
        assert st.n_grammar_dropped > 0 and st.n_grammar_masked == 0, st
    unconstrained = model_head.generate(prompt, 60, temp=0, mode=mode, **extra)
    assert model_head.last_stats.n_grammar_dropped == 0 == model_head.last_stats.n_grammar_masked, unconstrained


@pytest.mark.slow
@pytest.mark.parametrize("mode,i", [("eagle", 28), ("eagle2", 1), ("ngram", 1), ("auto", 28)])
def test_speculative_modes_take_the_forced_tokens_in_one_pass(model_head: Model, mode: str, i: int) -> None:
    """Jump-forward inside the drafters' modes: where the schema forces the next tokens (keys, quotes, braces) they are
    the step's tree, so a schema reply takes fewer passes than tokens even where drafts fail, and stays plain
    decoding's (greedy, and seeded sampling: the forced rows are drawn as plain decoding draws them)."""
    prompt = chat(PROMPTS[i % 3])
    for sampling in ({"temp": 0}, {"temp": 0.8, "seed": 3}):
        plain = model_head.generate(prompt, 120, mode="plain", json_schema=SCHEMAS[i], jump_forward=False,
                                    **sampling)
        model_head.ngram_cache_clear()  # lookup would copy plain's reply from the cross-request store
        spec = model_head.generate(prompt, 120, mode=mode, json_schema=SCHEMAS[i], **sampling)
        st = model_head.last_stats
        if sampling["temp"] == 0 or mode == "ngram":  # lookup's point drafts: plain decoding's seeded draws
            assert spec == plain, (mode, i, sampling)
        check_json(spec, SCHEMAS[i])
        model_head.ngram_cache_clear()
        off = model_head.generate(prompt, 120, mode=mode, json_schema=SCHEMAS[i], jump_forward=False, **sampling)
        st_off = model_head.last_stats
        if sampling["temp"] == 0:
            assert off == plain
            # the forced chains' steps: fewer steps than with jump-forward off, for the same tokens
            assert st.n_steps < st_off.n_steps, (mode, i, st.n_steps, st_off.n_steps)


@pytest.mark.slow
def test_masks_off_the_critical_path_keep_the_output(model: Model) -> None:
    """grammar_overlap (the next mask computed by a worker while the pass runs) changes nothing but where the mask is
    computed: greedy and seeded sampled outputs are the same with it off, and with it off the decoding thread spends
    time on masks (t_mask_ms) in every mode that draws through the grammar."""
    for sampling in ({"temp": 0}, {"temp": 0.8, "seed": 7}):
        for jump in (False, True):
            kw = dict(mode="plain", json_schema=SCHEMAS[28], jump_forward=jump, **sampling)
            on = model.generate(chat(PROMPTS[0]), 80, **kw)
            off = model.generate(chat(PROMPTS[0]), 80, grammar_overlap=False, **kw)
            assert model.last_stats.t_mask_ms > 0
            assert on == off, (sampling, jump)
    model.generate(chat(PROMPTS[0]), 20, temp=0, mode="plain")
    assert model.last_stats.t_mask_ms == 0  # no grammar, no masks


@pytest.mark.slow
def test_jump_forward_batches_forced_tokens_and_keeps_the_output(model: Model) -> None:
    """Plain decoding under a grammar: the forced tokens go into the next pass as drafts; greedy output is the same
    as one token per pass, in fewer passes."""
    for i in (1, 28, 32, 34):
        prompt = chat(PROMPTS[i % 3])
        one = model.generate(prompt, 150, temp=0, mode="plain", json_schema=SCHEMAS[i], jump_forward=False)
        assert model.last_stats.n_drafted == 0
        jumped = model.generate(prompt, 150, temp=0, mode="plain", json_schema=SCHEMAS[i])
        st = model.last_stats
        assert jumped == one
        assert st.n_drafted > 0 and st.n_steps < st.n_decoded, (st.n_steps, st.n_decoded)
        check_json(jumped, SCHEMAS[i])


@pytest.mark.slow
def test_sampled_eagle2_stays_inside_the_grammar(model_head: Model) -> None:
    for seed in range(3):
        out = model_head.generate(chat(PROMPTS[0]), 120, temp=0.9, seed=seed, mode="eagle2", json_schema=SCHEMAS[1])
        check_json(out, SCHEMAS[1])


@pytest.mark.slow
def test_early_exit_exits_only_with_allowed_tokens(model_head: Model) -> None:
    for schema in (SCHEMAS[1], SCHEMAS[32]):
        out = model_head.generate(chat(PROMPTS[0]), 150, temp=0, mode="early-exit", json_schema=schema)
        assert model_head.last_stats.stop_reason == "eog"
        check_json(out, schema)


def test_tree_exit_and_checked_exits_refuse_a_grammar(model_head: Model) -> None:
    with pytest.raises(SpecEEError, match="a grammar does not go with tree exit"):
        model_head.generate("x", 4, temp=0, mode="tree-exit", json_schema={})
    with pytest.raises(SpecEEError, match=re.escape("a grammar does not go with checked exits (exit check)")):
        model_head.generate("x", 4, temp=0, mode="early-exit", exit=ExitParams(check=True), json_schema={})


@pytest.mark.slow
def test_slots_decode_under_each_requests_grammar(model: Model) -> None:
    """Requests with different grammars side by side in one batch: each gives what it gives alone."""
    prompts = [model.prompt_tokens(chat(p)) for p in PROMPTS[:2]]
    alone = [model.generate_tokens(prompts[0], 80, temp=0, mode="plain", json_schema=SCHEMAS[1]),
             model.generate_tokens(prompts[1], 80, temp=0, mode="plain", grammar=GBNF_LIST)]
    slots = model.slots(2)
    a = slots.submit(prompts[0], 80, temp=0, mode="plain", json_schema=SCHEMAS[1])
    b = slots.submit(prompts[1], 80, temp=0, mode="plain", grammar=GBNF_LIST)
    for _ in range(200):
        if slots.step() == 0:
            break
    assert [slots.read(a).tokens, slots.read(b).tokens] == alone


@pytest.mark.slow
def test_slots_jump_forward_in_the_shared_pass(model: Model) -> None:
    """A slot under a schema puts the tokens its grammar forces into the shared pass as its own chain of draft rows
    (jump-forward), beside a plain slot without a grammar: each gives what it gives alone, the schema's slot in fewer
    steps than tokens, and with jump_forward off the same tokens one per pass."""
    prompts = [model.prompt_tokens(chat(p)) for p in PROMPTS[:2]]
    for i in (1, 32):
        alone = [model.generate_tokens(prompts[0], 80, temp=0, mode="plain", json_schema=SCHEMAS[i]),
                 model.generate_tokens(prompts[1], 30, temp=0, mode="plain")]
        for jump in (True, False):
            slots = model.slots(2)
            a = slots.submit(prompts[0], 80, temp=0, mode="plain", json_schema=SCHEMAS[i], jump_forward=jump)
            b = slots.submit(prompts[1], 30, temp=0, mode="plain")
            for _ in range(200):
                if slots.step() == 0:
                    break
            st = slots.stats(a)
            assert [slots.read(a).tokens, slots.read(b).tokens] == alone, (i, jump)
            if jump:
                assert st["n_drafted"] > 0 and st["n_steps"] < st["n_decoded"], st
            else:
                assert st["n_drafted"] == 0 and st["n_steps"] == st["n_decoded"], st
            assert slots.stats(b)["n_drafted"] == 0


@pytest.mark.slow
def test_auto_decodes_plainly_under_a_grammar_with_jump_forward(model_head: Model) -> None:
    """auto under a schema with jump-forward: plain decoding (the forced tokens batched; drafting on top measured
    slower, docs/structured-output.md), said in mode_why; without jump-forward, or with a tree given, auto decides as
    without a grammar."""
    prompt = chat(PROMPTS[1])
    model_head.generate(prompt, 20, temp=0, json_schema=SCHEMAS[1])
    st = model_head.last_stats
    assert st.mode == "plain" and "under a grammar jump-forward" in st.mode_why, st.mode_why
    model_head.generate(prompt, 20, temp=0, json_schema=SCHEMAS[1], jump_forward=False)
    assert model_head.last_stats.mode != "plain"
    model_head.generate(prompt, 20, temp=0, json_schema=SCHEMAS[1], eagle=EagleParams(total_tokens=2, depth=2, topk=1))
    assert model_head.last_stats.mode == "eagle2"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eagle2", "ngram"])
def test_slots_speculative_slot_takes_the_forced_tokens(model_head: Model, mode: str) -> None:
    """A speculative slot under a schema beside a plain slot: where its grammar forces more tokens than its drafts
    reach, the forced chain is its tree in the shared pass (the rule of the generator's step): the same tokens as
    plain decoding alone, in fewer steps than with jump_forward off."""
    prompts = [model_head.prompt_tokens(chat(p)) for p in PROMPTS[:2]]
    alone = [model_head.generate_tokens(prompts[0], 80, temp=0, mode="plain", json_schema=SCHEMAS[1]),
             model_head.generate_tokens(prompts[1], 30, temp=0, mode="plain")]
    steps = {}
    for jump in (True, False):
        model_head.ngram_cache_clear()
        slots = model_head.slots(2)
        a = slots.submit(prompts[0], 80, temp=0, mode=mode, json_schema=SCHEMAS[1], jump_forward=jump)
        b = slots.submit(prompts[1], 30, temp=0, mode="plain")
        for _ in range(200):
            if slots.step() == 0:
                break
        assert [slots.read(a).tokens, slots.read(b).tokens] == alone, (mode, jump)
        steps[jump] = slots.stats(a)["n_steps"]
    assert steps[True] < steps[False], steps


# ---- the CLI --------------------------------------------------------------------------------------------


def run_cli(smollm2_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(tool_path("llama-cli")), "-m", str(smollm2_path), "-no-cnv", "--temp", "0", "-t", "1",
                           "--no-display-prompt", *args], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def cli_text(r: subprocess.CompletedProcess) -> str:
    """The generated text: llama-cli ends it with " [end of text]" where the model ended it."""
    out = r.stdout.rstrip("\n")
    assert out.endswith(" [end of text]"), r.stdout
    return out[: -len(" [end of text]")]


@pytest.mark.slow
def test_cli_json_schema_and_grammar_file(smollm2_path: Path, tmp_path: Path) -> None:
    schema = SCHEMAS[1]
    r = run_cli(smollm2_path, "-p", "A person as JSON:", "-n", "80", "-j", json.dumps(schema))
    assert r.returncode == 0, r.stderr
    check_json(cli_text(r), schema)
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    r2 = run_cli(smollm2_path, "-p", "A person as JSON:", "-n", "80", "-jf", str(tmp_path / "schema.json"))
    assert r2.stdout == r.stdout
    (tmp_path / "list.gbnf").write_text(GBNF_LIST)
    r = run_cli(smollm2_path, "-p", "A shopping list:\n", "-n", "60", "--grammar-file", str(tmp_path / "list.gbnf"))
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(LIST_RE, cli_text(r)), r.stdout


def test_cli_refuses_a_malformed_grammar(smollm2_path: Path) -> None:
    r = run_cli(smollm2_path, "-p", "x", "-n", "4", "--grammar", "root ::= (")
    assert r.returncode != 0
    assert "gbnf: line 1: a '(' without its ')'" in r.stderr


# ---- the server -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(smollm2_path: Path) -> Iterator[Server]:
    s = Server(smollm2_path, "-np", "2", "-c", "2048", "--mode", "plain")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


@pytest.mark.slow
def test_openai_response_format(client: OpenAI) -> None:
    schema = SCHEMAS[2]
    r = client.chat.completions.create(model="x", messages=chat(PROMPTS[0]), temperature=0, max_tokens=100,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "person", "schema": schema, "strict": True}})
    check_json(r.choices[0].message.content, schema)
    r = client.chat.completions.create(model="x", messages=chat("A JSON object with the name and age of Ada, 36."),
                                       temperature=0, max_tokens=200, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.slow
def test_openai_parse_with_a_pydantic_model(client: OpenAI) -> None:
    class Person(BaseModel):
        name: str = Field(max_length=16)
        age: int = Field(ge=0, le=120)

    r = client.beta.chat.completions.parse(model="x", messages=chat(PROMPTS[0]), temperature=0, max_tokens=100,
                                           response_format=Person)
    assert isinstance(r.choices[0].message.parsed, Person)


@pytest.mark.slow
def test_llama_cpp_fields(server: Server) -> None:
    r = call(server.port, "POST", "/completion", {"prompt": "A shopping list:\n", "n_predict": 60, "temperature": 0,
                                                  "grammar": GBNF_LIST})
    assert r.status_code == 200, r.text
    assert re.fullmatch(LIST_RE, r.json()["content"]), r.text
    r = call(server.port, "POST", "/completion", {"prompt": "A person as JSON:", "n_predict": 80, "temperature": 0,
                                                  "json_schema": SCHEMAS[1]})
    assert r.status_code == 200, r.text
    check_json(r.json()["content"], SCHEMAS[1])


@pytest.mark.parametrize("body,message", [
    ({"grammar": "root ::= ("}, "gbnf: line 1: a '(' without its ')'"),
    ({"json_schema": {"type": "objekt"}}, "json_schema: "),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}}, "json_schema: "),
    ({"response_format": {"type": "xml"}}, "'response_format' type must be text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     "'strict' must be true or false"),
    ({"grammar": "root ::= \"a\"", "json_schema": {}}, "one structured-output field at a time"),
    ({"grammar": 5}, "'grammar' must be a non-empty GBNF grammar"),
])
def test_malformed_grammars_get_a_400_and_the_server_keeps_serving(server: Server, body: dict, message: str) -> None:
    r = call(server.port, "POST", "/v1/chat/completions", {"messages": chat("hi"), "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    ok = call(server.port, "POST", "/v1/chat/completions", {"messages": chat("hi"), "max_tokens": 4,
                                                            "response_format": {"type": "json_object"}})
    assert ok.status_code == 200, ok.text


def test_the_type_of_a_structured_output_text_is_the_librarys_rule() -> None:
    """A schema is json_schema, a grammar the type asked for (gbnf for none): one rule in the library
    (specee_grammar_type_of) that the CLI and GenerateOptions both ask."""
    none, gbnf, schema, lark = (_core.GRAMMAR_GBNF - 1, _core.GRAMMAR_GBNF, _core.GRAMMAR_JSON_SCHEMA,
                                _core.GRAMMAR_LARK)
    assert _core.grammar_type_of(none, True) == _core.grammar_type_of(schema, True) == schema
    assert (_core.grammar_type_of(none, False), _core.grammar_type_of(lark, False)) == (gbnf, lark)
    with pytest.raises(ValueError, match="not grammar_type lark"):
        _core.grammar_type_of(lark, True)
    with pytest.raises(ValueError, match="give the schema as one"):
        _core.grammar_type_of(schema, False)
    o = GenerateOptions(json_schema={"type": "object"})
    assert (o.grammar_type, o.grammar_spec) == ("json_schema", (schema, '{"type": "object"}'))
    assert GenerateOptions(grammar='root ::= "a"').grammar_spec == (gbnf, 'root ::= "a"')
