"""The design grammar: a formula is parsed into terms here, and only this grammar reaches formulaic.

formulaic evaluates each factor of a formula as Python code (``np.save('f', 0)`` in a design string would run), and a
design string may come from a file (``uns[key]["params"]["design"]`` of a shared h5ad, replayed as
``gpuc.tl.deseq(adata, **params)``). So a design is accepted only when every term is made of:

- ``name`` (a Python identifier) or ```any name``` (backticks): a column of ``obs``;
- ``C(variable)``, ``C(variable, contr.treatment(<literal>))``, ``C(variable, contr.treatment(base=<literal>))``,
  ``C(variable, Treatment(<literal>))`` or ``C(variable, levels=[<literal>, ...])``: a factor, with its reference
  level or level order;
- ``f(variable)`` for ``f`` in :data:`TRANSFORMS` (numeric transforms);
- ``:`` (interaction) and ``*`` (main effects and interaction) between them, ``+`` between terms, and ``1`` / ``0``
  / ``- 1`` for the intercept.

Literals are numbers, quoted strings, ``True``/``False``. Anything else (attribute access, other calls, operators,
subscripts) is refused with a :class:`ValueError` naming the term, before formulaic sees the formula; what formulaic
gets is the formula rebuilt from the parsed terms.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

# numeric transforms a design may apply to a variable (formulaic evaluates these names in its own namespace)
TRANSFORMS = (
    "log", "log2", "log10", "exp",
    "np.log", "np.log2", "np.log10", "np.log1p", "np.exp", "np.sqrt",
)  # fmt: skip

GRAMMAR = (
    "a design may only hold obs column names (`backticks` for other names), interactions (a:b, a*b), C(x) with an "
    "optional reference (C(x, contr.treatment('ref')), C(x, Treatment('ref')), C(x, levels=[...])), the numeric "
    f"transforms {', '.join(t + '(x)' for t in TRANSFORMS)}, and 1, 0 or - 1 for the intercept"
)

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<backtick>`[^`]*`)
      | (?P<string>'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")
      | (?P<number>[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)
      | (?P<name>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
      | (?P<op>\*\*|[~+\-:*(),=\[\]])
      | (?P<other>\S)
    )""",
    re.VERBOSE,
)


@dataclass
class ParsedFormula:
    """A design formula after :func:`parse_formula`: the formula rebuilt from its terms, and the variables it reads
    (``obs`` column names, in order of appearance).
    """

    formula: str
    variables: list[str]


class _Refused(ValueError):
    pass


def _tokens(text: str) -> list[tuple[str, str]]:
    out = []
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup
        if kind is None:
            continue
        out.append((kind, m.group(kind)))
    return out


def _split_terms(tokens: list[tuple[str, str]]) -> list[tuple[str, list[tuple[str, str]]]]:
    """The right-hand side split at top-level ``+`` and ``-`` into (sign, tokens) terms."""
    terms: list[tuple[str, list[tuple[str, str]]]] = []
    sign, cur, depth = "+", [], 0
    for kind, val in tokens:
        if kind == "op" and val in "([":
            depth += 1
        elif kind == "op" and val in ")]":
            depth -= 1
        if kind == "op" and val in "+-" and depth == 0:
            if cur or terms or val == "-":
                terms.append((sign, cur))
            sign, cur = val, []
            continue
        cur.append((kind, val))
    terms.append((sign, cur))
    return [(s, t) for s, t in terms if t or s == "-"]


def _show(tokens: list[tuple[str, str]]) -> str:
    text = ""
    for _kind, val in tokens:
        text += ("" if not text or val in "(),]:" or text.endswith(("(", "[")) else " ") + val
    return text.replace(" ,", ",")


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.tokens = tokens
        self.i = 0
        self.variables: list[str] = []

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, kind: str | None = None, value: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if tok is None or (kind is not None and tok[0] != kind) or (value is not None and tok[1] != value):
            raise _Refused
        self.i += 1
        return tok

    def at(self, kind: str, value: str | None = None) -> bool:
        tok = self.peek()
        return tok is not None and tok[0] == kind and (value is None or tok[1] == value)

    def literal(self) -> str:
        kind, val = self.take()
        if kind == "op" and val == "-" and self.at("number"):
            val = "-" + self.take("number")[1]
            kind = "number"
        if kind in ("string", "number") or (kind == "name" and val in ("True", "False")):
            return repr(ast.literal_eval(val))  # a literal only: literal_eval evaluates nothing else
        raise _Refused

    def variable(self) -> str:
        kind, val = self.take()
        if kind == "backtick":
            name = val[1:-1]
            if not name:
                raise _Refused
            self.variables.append(name)
            return val
        if kind == "name" and "." not in val and val not in ("True", "False", "None"):
            self.variables.append(val)
            return val
        raise _Refused

    def reference(self) -> str:
        """The second argument of ``C()``: a treatment coding with its reference, or ``levels=[...]``."""
        _kind, val = self.take("name")
        if val == "levels":
            self.take("op", "=")
            self.take("op", "[")
            items = [self.literal()]
            while self.at("op", ","):
                self.take()
                items.append(self.literal())
            self.take("op", "]")
            return f"levels=[{', '.join(items)}]"
        if val not in ("contr.treatment", "Treatment"):
            raise _Refused
        self.take("op", "(")
        keyword = ""
        if self.at("name", "base"):
            self.take()
            self.take("op", "=")
            keyword = "base="
        lit = self.literal()
        self.take("op", ")")
        return f"{val}({keyword}{lit})"

    def factor(self) -> str:
        kind, val = self.peek() or ("", "")
        if kind == "name" and self.i + 1 < len(self.tokens) and self.tokens[self.i + 1] == ("op", "("):
            self.take()
            self.take("op", "(")
            if val == "C":
                inner = self.variable()
                if self.at("op", ","):
                    self.take()
                    inner += ", " + self.reference()
            elif val in TRANSFORMS:
                inner = self.variable()
            else:
                raise _Refused
            self.take("op", ")")
            return f"{val}({inner})"
        return self.variable()

    def term(self) -> str:
        parts = [self.factor()]
        while self.at("op", ":") or self.at("op", "*"):
            op = self.take()[1]
            parts.append(op)
            parts.append(self.factor())
        if self.peek() is not None:
            raise _Refused
        return " ".join(parts).replace(" : ", ":")


def parse_formula(design: str, what: str = "design") -> ParsedFormula:
    """Check ``design`` against the grammar of this module and rebuild it from its terms.

    Raises a :class:`ValueError` naming the first term outside the grammar (and the grammar), or when the string is
    not a formula (``"~ ..."``). Nothing of the string is evaluated.
    """
    if not isinstance(design, str):
        msg = f"{what} must be a formula string such as '~condition', got {design!r}."
        raise TypeError(msg)
    tokens = _tokens(design)
    if not tokens or tokens[0] != ("op", "~"):
        msg = f"{what} must be a formula string starting with '~' (e.g. '~condition'), got {design!r}."
        raise ValueError(msg)
    rhs = tokens[1:]
    if not rhs:
        msg = f"{what} {design!r} has no terms; use '~1' for an intercept-only design."
        raise ValueError(msg)
    parts: list[str] = []
    variables: list[str] = []
    for i, (sign, term) in enumerate(_split_terms(rhs)):
        shown = _show(term) if term else sign
        try:
            if any(kind == "other" for kind, _ in term):
                raise _Refused
            if len(term) == 1 and term[0][0] == "number" and term[0][1] in ("0", "1"):
                text = term[0][1]  # the intercept: 1 keeps it, 0 or - 1 drops it
            else:
                if sign == "-":
                    raise _Refused
                parser = _Parser(term)
                text = parser.term()
                variables += parser.variables
        except _Refused:
            msg = (
                f"{what} {design!r}: the term {shown!r} is not allowed; {GRAMMAR}. Nothing else in a formula is "
                "accepted, so that a design read from a file can never run code."
            )
            raise ValueError(msg) from None
        parts.append(text if i == 0 and sign == "+" else f"{sign} {text}")
    seen: list[str] = []
    for v in variables:
        if v not in seen:
            seen.append(v)
    return ParsedFormula("~" + " ".join(parts), seen)
