"""Structured output: what a generation's `grammar=` / `json_schema=` become for the runtime.

The runtime's sampler masks every draw with a grammar compiled by llguidance (csrc/decode/specee-grammar.cpp,
docs/structured-output.md). This module turns the Python forms into the runtime's (type, text) pair: a GBNF or Lark
grammar as text; a JSON Schema as a dict, a JSON string, or a pydantic model class (its `model_json_schema()`); and
points the runtime at the installed llguidance package's library.
"""

import json
from typing import Any

from specee import _core

# the grammar types' names by enum specee_grammar_type, as the runtime's option table names them
GRAMMAR_TYPE_NAMES: tuple[str, ...] = tuple(
    next(o["choices"] for o in _core.generator_options() if o["name"] == "grammar_type"))
# the grammar types by name ("none" aside)
GRAMMAR_TYPES: dict[str, int] = {name: i for i, name in enumerate(GRAMMAR_TYPE_NAMES) if name != "none"}


class StructuredOutputConflict(ValueError):
    """More than one field holds the output to a grammar; `names`: those fields, in the order given."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(f"give {' or '.join(names)}, not both")
        self.names = names


def structured_output_of(given: dict[str, Any]) -> str | None:
    """The one rule of structured output, checked here only: at most one of grammar / json_schema / response_format /
    tools (whichever a frontend has) holds a generation's output. `given`: field name -> its value, None where the
    field is absent or asks for nothing; returns the name of the one given, None for none; StructuredOutputConflict
    when more than one is."""
    names = [name for name, value in given.items() if value is not None]
    if len(names) > 1:
        raise StructuredOutputConflict(names)
    return names[0] if names else None


def schema_text(schema: Any) -> str:
    """A JSON Schema as the runtime takes it: JSON text from a dict, a JSON string or a pydantic model class."""
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema: not JSON: {e}") from None
        return schema
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        return json.dumps(schema.model_json_schema())
    if isinstance(schema, (dict, bool)):
        return json.dumps(schema)
    raise ValueError(f"json_schema: a dict, a JSON string or a pydantic model class, not {type(schema).__name__}")


def grammar_spec(grammar: str | None, json_schema: Any, grammar_type: str = "none") -> tuple[int, str] | None:
    """(type, text) for the runtime, None for no constraint; the type is the library's rule (a schema's json_schema,
    a grammar's `grammar_type`, gbnf for "none": _core.grammar_type_of); ValueError when both are given, the type
    does not fit, or one is malformed in a way found before compiling."""
    structured_output_of({"grammar": grammar, "json_schema": json_schema})
    if json_schema is not None:
        text = schema_text(json_schema)
    elif grammar is None:
        return None
    elif not isinstance(grammar, str):
        raise ValueError(f"grammar: GBNF or Lark text, not {type(grammar).__name__}")
    else:
        text = grammar
    kind = _core.grammar_type_of(GRAMMAR_TYPE_NAMES.index(grammar_type), json_schema is not None)
    use_library()
    return kind, text


def use_library() -> None:
    """Point the runtime at the installed llguidance package's library (before its first grammar)."""
    try:
        import llguidance._lib as lib
    except ImportError:
        raise ValueError("structured output needs the llguidance package: pip install llguidance") from None
    _core.grammar_set_library(lib.__file__)


def check(model, grammar: str | None = None, json_schema: Any = None) -> None:
    """Compiles the grammar or schema for the model's vocabulary (specee.Model) through the runtime's front door
    (its limits, a compile within a budget on a worker thread, the cache of compiled grammars: a generation with the
    same text then starts at once); SpecEEError with a short message naming the problem when it does not compile or
    passes a limit, ValueError for a malformed argument. Releases the GIL while it compiles."""
    spec = grammar_spec(grammar, json_schema)
    if spec is not None:
        model.grammar_check(*spec)


def check_spec(model, spec: tuple[int, str] | None) -> None:
    """check() of a (type, text) pair as GenerateOptions.grammar_spec gives it."""
    if spec is not None:
        use_library()
        model.grammar_check(*spec)


def limits() -> dict[str, int]:
    """The grammar front door's limits (the runtime's one table: csrc/decode/specee-grammar-limits.cpp), by name."""
    return {name: value for name, (value, _help) in _core.grammar_limits().items()}


def set_limit(name: str, value: int) -> None:
    """Changes one of limits() for the process (SpecEEError for an unknown name or a value < 1)."""
    _core.grammar_set_limit(name, value)


def cache_info() -> dict[str, int]:
    """The cache of compiled grammars: entries kept, and hits (compiles saved) since the process started."""
    return _core.grammar_cache_info()


def cache_clear() -> None:
    """Drops every compiled grammar kept (their memory goes back to the system)."""
    _core.grammar_cache_clear()


def n_abandoned() -> int:
    """Compiles abandoned past their budget (compile_ms, compile_mb) whose workers still run: the engine cannot be
    stopped, so each finishes on its own and frees what it made (while two run, new compiles are refused)."""
    return _core.grammar_n_abandoned()
