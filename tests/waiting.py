"""Waiting on a condition instead of sleeping a fixed time: a test that sleeps is either
slow (the sleep is longer than needed) or flaky (it is not, on a loaded machine)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.01,
               message: str | Callable[[], str] = "") -> T:
    """Call `predicate` every `interval` seconds until it returns something truthy, and
    return that; fail the test (AssertionError) after `timeout` seconds. `message` (or a
    function giving it, called only on failure) says what was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"not true within {timeout} s: {text or getattr(predicate, '__name__', predicate)}")
        time.sleep(interval)


async def async_wait_until(predicate: Callable[[], T | Awaitable[T]], timeout: float = 10.0, interval: float = 0.01,
                           message: str = "") -> T:
    """`wait_until` in a coroutine: yields to the event loop between the calls; `predicate`
    may be a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {message or getattr(predicate, '__name__', predicate)}")
        await asyncio.sleep(interval)
