"""How the conformance suites report: a broken rule is an ``AssertionError`` naming the rule and the component."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class RuleBroken(AssertionError):
    """A component broke one of the rules its kind keeps (pytest shows it as a failed assertion)."""


def describe(component: Any) -> str:
    """``module.Class`` of a class or factory, for messages."""
    target = getattr(component, "func", component)  # functools.partial
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"


@contextmanager
def rule(check: Callable[..., Any], component: Any) -> Iterator[None]:
    """Run one rule's check: what it raises becomes a ``RuleBroken`` saying which rule, what it asks and of what."""
    name = check.__name__.strip("_").replace("_", " ")
    asks = " ".join((check.__doc__ or "").split())
    try:
        yield
    except RuleBroken as exc:
        raise RuleBroken(f"{describe(component)} breaks the rule '{name}' ({asks}): {exc}") from None
    except Exception as exc:
        raise RuleBroken(
            f"{describe(component)} raised {type(exc).__name__}: {exc} while checking the rule '{name}' ({asks})"
        ) from exc
