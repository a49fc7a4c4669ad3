"""Progress bars for long work: tqdm when it is installed (an optional extra), else a plain fallback."""

from __future__ import annotations

import sys


def progress_bar(total: int, desc: str, *, unit: str = "it", enabled: bool = True, text: bool = False):
    """A bar with ``update(n=1)``, ``set_postfix_str(s)`` and ``close()``.

    Without tqdm (``pip install tqdm``, or the ``progress`` extra) it is silent, or with
    ``text=True`` prints a line to stderr every 10% (for work that takes minutes).
    """
    if enabled:
        try:
            from tqdm.auto import tqdm

            return tqdm(total=total, desc=desc, unit=unit, leave=False)
        except ImportError:
            pass
    return _TextBar(total, desc, enabled and text)


class _TextBar:
    def __init__(self, total: int, desc: str, enabled: bool):
        self.total, self.desc, self.enabled, self.n, self.next = total, desc, enabled, 0, 0

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.enabled and self.n >= self.next:
            print(f"  {self.desc}: {self.n}/{self.total}", file=sys.stderr, flush=True)
            self.next += max(1, self.total // 10)

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass
