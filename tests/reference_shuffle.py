"""An independent, pure-Python statement of the documented shuffle (docs/architecture.md,
"Access streams"): PCG-XSL-RR 128/64 seeded via SplitMix64, Lemire bounded integers,
Fisher-Yates. Tests compare the native schedule against it."""

M64 = (1 << 64) - 1
M128 = (1 << 128) - 1
PCG_MULT = 0x2360ED051FC65DA44385DF649FCCF645
PCG_STREAM = 0x5851F42D4C957F2D14057B7EF767814F


def splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


class Pcg64:
    def __init__(self, state: int, stream: int):
        self.inc = ((stream << 1) | 1) & M128
        self.state = (state + self.inc) & M128
        self._step()

    def _step(self):
        self.state = (self.state * PCG_MULT + self.inc) & M128

    def next_u64(self) -> int:
        self._step()
        s = self.state
        rot = s >> 122
        x = ((s >> 64) ^ s) & M64
        return ((x >> rot) | (x << (64 - rot))) & M64


def bounded(rng: Pcg64, n: int) -> int:
    m = rng.next_u64() * n
    if (m & M64) < n:
        t = ((1 << 64) - n) % n
        while (m & M64) < t:
            m = rng.next_u64() * n
    return m >> 64


def permutation(n: int, seed: int, epoch: int) -> list:
    hi = splitmix64(seed)
    lo = splitmix64(seed ^ splitmix64((epoch + 1) & M64))
    rng = Pcg64((hi << 64) | lo, PCG_STREAM)
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = bounded(rng, i + 1)
        order[i], order[j] = order[j], order[i]
    return order


if __name__ == "__main__":
    print(permutation(10, 0, 0), permutation(10, 0, 1), permutation(10, 42, 0), permutation(1_000_000, 7, 3)[:5])
