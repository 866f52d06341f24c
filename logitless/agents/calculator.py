"""The built-in `calculator` tool: exact arithmetic on an expression, parsed with `ast` (never `eval`).

Numbers are integers (exact, up to `max_digits` digits, default 1000) and decimals ("1.25", "1e-3", read exactly, not as
binary floats); arithmetic is on exact fractions, so 0.1 + 0.2 is 0.3 and 10 / 4 is 2.5. Operators:
+ - * / // % ** and parentheses, unary minus; "×", "÷" and "−" are read as *, / and -. Functions: abs, min,
max, round(x[, digits]), floor, ceil, sqrt. A result that is not a finite decimal (1/3) is written with 20
significant digits; irrational steps (sqrt(2), 2 ** 0.5) are rounded to 20 significant digits. Anything else
(names, attributes, comparisons, strings, huge powers) is refused with a message saying what is allowed.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from decimal import Context, Decimal, localcontext
from fractions import Fraction
from typing import Callable

MAX_EXPRESSION_CHARS = 1000
MAX_NODES = 300
SIGNIFICANT_DIGITS = 20


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message is written for the model."""


def _decimal(q: Fraction, digits: int) -> Decimal:
    with localcontext(Context(prec=digits)):
        return Decimal(q.numerator) / Decimal(q.denominator)


def _sqrt(x: Fraction) -> Fraction | None:
    """The exact square root, or None when it is irrational."""
    if x < 0:
        raise CalculatorError("sqrt of a negative number")
    n, d = math.isqrt(x.numerator), math.isqrt(x.denominator)
    return Fraction(n, d) if n * n == x.numerator and d * d == x.denominator else None


def _round(x: Fraction, digits: Fraction = Fraction(0)) -> Fraction:
    if digits.denominator != 1 or abs(digits) > 100:
        raise CalculatorError("round(x, digits) needs a whole number of digits between -100 and 100")
    return Fraction(round(x, int(digits)))


FUNCTIONS: dict[str, tuple[Callable[..., Fraction], int, int]] = {  # name: (function, min args, max args)
    "abs": (abs, 1, 1),
    "min": (min, 1, 64),
    "max": (max, 1, 64),
    "round": (_round, 1, 2),
    "floor": (lambda x: Fraction(math.floor(x)), 1, 1),
    "ceil": (lambda x: Fraction(math.ceil(x)), 1, 1),
    "sqrt": (lambda x: x, 1, 1),  # evaluated in Calculator._call
}


@dataclass
class _State:
    text: str  # the expression's source (literals are read from it exactly)
    inexact: bool = False  # a step was rounded to SIGNIFICANT_DIGITS


class Calculator:
    """Evaluates arithmetic expressions exactly; `max_digits` bounds every integer, numerator and denominator."""

    def __init__(self, max_digits: int = 1000) -> None:
        if isinstance(max_digits, bool) or not isinstance(max_digits, int) or not 1 <= max_digits <= 4000:
            # 4000: below Python's limit on converting integers to text (sys.get_int_max_str_digits, 4300)
            raise ValueError(f"calculator max_digits must be an int in [1, 4000], got {max_digits!r}")
        self.max_digits = max_digits
        self._limit = 10**max_digits

    def __call__(self, expression: str) -> str:
        """The value of `expression` as text (integers exact, finite decimals exact, others to 20 digits)."""
        st = _State("")
        value = self.evaluate(expression, st)
        return format_number(value, exact=not st.inexact)

    def evaluate(self, expression: str, st: _State | None = None) -> Fraction:
        """The exact value (`st.inexact` is set when a step had to round: sqrt, fractional powers)."""
        st = st if st is not None else _State("")
        if not isinstance(expression, str):
            raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
        text = expression.strip().replace("×", "*").replace("÷", "/").replace("−", "-")
        if not text:
            raise CalculatorError("empty expression; write e.g. 12 * (3 + 4)")
        if len(text) > MAX_EXPRESSION_CHARS:
            raise CalculatorError(f"the expression has {len(text)} characters, more than {MAX_EXPRESSION_CHARS}")
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError as e:
            raise CalculatorError(f"cannot parse {text!r} ({e.msg}); write e.g. 12 * (3 + 4)") from None
        st.text = text
        nodes = sum(1 for _ in ast.walk(tree))
        if nodes > MAX_NODES:
            raise CalculatorError(f"the expression is too long ({nodes} parts, at most {MAX_NODES})")
        return self._eval(tree.body, st)

    def _check(self, q: Fraction) -> Fraction:
        if abs(q.numerator) >= self._limit or q.denominator >= self._limit:
            raise CalculatorError(f"a number in the computation has more than {self.max_digits} digits")
        return q

    def _eval(self, node: ast.AST, st: _State) -> Fraction:
        if isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise CalculatorError(f"{v!r} is not a number")
            if isinstance(v, float):  # the literal's digits, read exactly (not the binary float)
                literal = ast.get_source_segment(st.text, node) or repr(v)
                if not math.isfinite(v):
                    raise CalculatorError(f"{literal} is too large")
                return self._check(Fraction(Decimal(literal)))
            return self._check(Fraction(v))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = self._eval(node.operand, st)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp):
            return self._binop(node, st)
        if isinstance(node, ast.Call):
            return self._call(node, st)
        if isinstance(node, ast.Tuple):
            raise CalculatorError("a comma outside a function call; write numbers without thousands separators")
        if isinstance(node, ast.Name):
            raise CalculatorError(f"unknown name {node.id!r}; functions: {', '.join(FUNCTIONS)}")
        raise CalculatorError(f"{type(node).__name__} is not allowed; use numbers, + - * / // % ** and parentheses")

    def _binop(self, node: ast.BinOp, st: _State) -> Fraction:
        op = node.op
        if isinstance(op, ast.BitXor):
            raise CalculatorError("^ is not a power here; write 2 ** 10")
        if not isinstance(op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)):
            raise CalculatorError(f"operator {type(op).__name__} is not allowed; use + - * / // % **")
        a, b = self._eval(node.left, st), self._eval(node.right, st)
        if isinstance(op, ast.Add):
            return self._check(a + b)
        if isinstance(op, ast.Sub):
            return self._check(a - b)
        if isinstance(op, ast.Mult):
            return self._check(a * b)
        if isinstance(op, ast.Pow):
            return self._power(a, b, st)
        if b == 0:
            raise CalculatorError("division by zero")
        if isinstance(op, ast.Div):
            return self._check(a / b)
        if isinstance(op, ast.FloorDiv):
            return self._check(Fraction(a // b))
        return self._check(a % b)

    def _power(self, a: Fraction, b: Fraction, st: _State) -> Fraction:
        if a == 0 and b < 0:
            raise CalculatorError("division by zero (0 to a negative power)")
        if b.denominator == 1:
            e = abs(b.numerator)
            bits = max(abs(a.numerator).bit_length(), a.denominator.bit_length()) - 1  # >= half of log2 of it
            if a not in (0, 1, -1) and bits * e * 0.30103 > self.max_digits:
                raise CalculatorError(f"the power has more than {self.max_digits} digits")
            return self._check(a**b.numerator)
        if a < 0:
            raise CalculatorError("sqrt or a fractional power of a negative number")
        if b.denominator == 2 and (root := _sqrt(a)) is not None:  # exact: x ** (k/2) of a perfect square
            return self._power(root, Fraction(b.numerator), st)
        st.inexact = True
        if abs(b) > 10_000:
            raise CalculatorError("the exponent is too large")
        with localcontext(Context(prec=SIGNIFICANT_DIGITS, Emax=self.max_digits + 1, Emin=-self.max_digits - 1)):
            try:
                value = _decimal(a, 60) ** _decimal(b, 60)
            except ArithmeticError:
                raise CalculatorError(f"the power has more than {self.max_digits} digits") from None
        return self._check(Fraction(value))

    def _call(self, node: ast.Call, st: _State) -> Fraction:
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            name = node.func.id if isinstance(node.func, ast.Name) else ast.dump(node.func)[:40]
            raise CalculatorError(f"unknown function {name!r}; functions: {', '.join(FUNCTIONS)}")
        if node.keywords:
            raise CalculatorError(f"{node.func.id}() takes positional arguments only")
        fn, lo, hi = FUNCTIONS[node.func.id]
        if not lo <= len(node.args) <= hi:
            count = str(lo) if lo == hi else f"{lo} to {hi}"
            raise CalculatorError(f"{node.func.id}() takes {count} argument(s), got {len(node.args)}")
        args = [self._eval(a, st) for a in node.args]
        if node.func.id == "sqrt":
            return self._power(args[0], Fraction(1, 2), st)
        return self._check(Fraction(fn(*args)))


def format_number(q: Fraction, exact: bool = True) -> str:
    """A fraction as text: an integer, an exact decimal when the denominator divides a power of ten (and the
    result is short), else (or when not `exact`) 20 significant digits."""
    if not exact and q != 0:
        q = Fraction(_decimal(q, SIGNIFICANT_DIGITS))
    if q.denominator == 1:
        return str(q.numerator)
    d = q.denominator
    twos = fives = 0
    while d % 2 == 0:
        d //= 2
        twos += 1
    while d % 5 == 0:
        d //= 5
        fives += 1
    if d == 1 and max(twos, fives) <= 60:
        places = max(twos, fives)
        scaled = q.numerator * 10**places // q.denominator
        sign = "-" if scaled < 0 else ""
        digits = str(abs(scaled)).rjust(places + 1, "0")
        return f"{sign}{digits[:-places]}.{digits[-places:]}".rstrip("0").rstrip(".")
    text = format(_decimal(q, SIGNIFICANT_DIGITS), "f" if abs(q) >= Fraction(1, 10**6) else "e")
    if "e" not in text and "." in text:
        text = text.rstrip("0").rstrip(".")
    return text
