"""Progress of long steps on the terminal (``clairvoyant simulate``): a tqdm bar on a terminal,
plain lines in a log."""

from __future__ import annotations


class Progress:
    """Progress of a long step on ``stream`` (stderr by default).

    On a terminal with tqdm installed: a tqdm bar. Otherwise (no tqdm, or output piped to a file
    or a log collector) plain lines, one at most every ``interval`` seconds or each
    ``step`` of the total, whichever comes first, and ``<desc>: done in N s`` at the end, so a
    log shows that the step is alive and how far it got.
    """

    def __init__(self, desc: str, unit: str, stream=None, interval: float = 2.0, step: float = 0.1, bar: bool | None = None):
        import sys
        import time

        self.desc, self.unit = desc, unit
        self.stream = stream if stream is not None else sys.stderr
        self.interval, self.step = interval, step
        self._clock = time.monotonic
        self.start = self._clock()
        self._last_t, self._last_frac = self.start, 0.0
        self.done = self.total = 0
        self._tqdm = None
        tty = getattr(self.stream, "isatty", lambda: False)()
        if bar if bar is not None else tty:
            try:
                from tqdm import tqdm

                self._tqdm = tqdm(total=1, unit=f" {unit}", unit_scale=True, desc=desc, file=self.stream, leave=False)
            except ImportError:
                pass

    def update(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        if self._tqdm is not None:
            if total and self._tqdm.total != total:
                self._tqdm.total = total
            self._tqdm.n = done
            self._tqdm.refresh()
            return
        now = self._clock()
        frac = done / total if total else 0.0
        finished = frac >= 1.0 > self._last_frac
        if finished or now - self._last_t >= self.interval or frac - self._last_frac >= self.step - 1e-9:
            self._line(now)
            self._last_t, self._last_frac = now, frac

    def _line(self, now: float) -> None:
        elapsed = now - self.start
        if self.total:
            frac = self.done / self.total
            left = f", about {elapsed * (1 - frac) / frac:.0f} s left" if 0 < frac < 1 else ""
            text = f"{self.desc}: {self.done:,} of {self.total:,} {self.unit} ({frac:.0%}), {elapsed:.1f} s{left}"
        else:
            text = f"{self.desc}: {self.done:,} {self.unit}, {elapsed:.1f} s"
        print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None
        else:
            print(f"{self.desc}: done in {self._clock() - self.start:.1f} s", file=self.stream, flush=True)
