"""t-of-n Shamir secret sharing over the prime field F_p, p = 2^127 − 1 (a Mersenne prime).

A dealer hides a secret s ∈ F_p as the constant term of a random polynomial of degree t − 1,

    f(x) = s + a_1 x + … + a_{t−1} x^{t−1}   (mod p),

and gives holder h the share (x_h, f(x_h)) with x_h = h + 1 (client ids are ≥ 0, and x = 0 would
be the secret itself). Any t shares determine f, so the secret is Lagrange interpolation at 0:

    s = f(0) = Σ_{h∈H} y_h · Π_{m∈H, m≠h} x_m / (x_m − x_h)   (mod p),  |H| = t;

fewer than t shares say nothing about s (every value of s is equally likely), which is why
`reconstruct` refuses them instead of returning a guess. A wrong share among the t used gives a
wrong secret. Arithmetic is Python's exact integers; a share costs `SHARE_BYTES` on the wire.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

PRIME = (1 << 127) - 1
SHARE_BYTES = 16  # one element of F_p (127 bits)


def share(secret: int, coefficients: Sequence[int], holder: int) -> int:
    """Holder `holder`'s share f(holder + 1) of `secret` under f(x) = secret + Σ_i coefficients[i−1] x^i.

    `coefficients` (t − 1 random elements of F_p) fix the threshold t = len(coefficients) + 1.
    """
    x, value = holder + 1, 0
    for coefficient in reversed(coefficients):  # Horner, highest power first
        value = (value + coefficient) * x % PRIME
    return (value + secret) % PRIME


def split(secret: int, coefficients: Sequence[int], holders: Iterable[int]) -> dict[int, int]:
    """The shares {holder: f(holder + 1)} of `secret` for each of `holders` (see `share`), Horner's
    steps taken for all holders at once."""
    holders = list(holders)
    xs = [holder + 1 for holder in holders]
    values = [0] * len(xs)
    for coefficient in reversed(coefficients):
        values = [(value + coefficient) * x % PRIME for value, x in zip(values, xs, strict=True)]
    return {holder: (value + secret) % PRIME for holder, value in zip(holders, values, strict=True)}


def reconstruct(shares: Mapping[int, int], threshold: int, *, what: str = "a secret") -> int:
    """The secret from ≥ `threshold` shares {holder: f(holder + 1)}: Lagrange at 0 over the first t holders.

    With X = Π_m x_m and D_h = x_h · Π_{m≠h} (x_m − x_h), λ_h = X / D_h, so s = X · Σ_h y_h / D_h:
    the D_h are exact products of small integers (never 0 mod p: each factor is below p), summed
    as one fraction with a single inversion. A holder at x = 0 holds f(0) itself.
    Raises ValueError with fewer than t shares (they carry no information about the secret).
    """
    if len(shares) < threshold:
        raise ValueError(f"{what} needs {threshold} shares to be reconstructed, only {len(shares)} arrived")
    holders = sorted(shares)[:threshold]
    xs = [h + 1 for h in holders]
    if 0 in xs:
        return shares[holders[xs.index(0)]] % PRIME
    numerator, denominator = 0, 1
    for h, x_h in zip(holders, xs, strict=True):
        d_h = x_h * math.prod([x_m - x_h for x_m in xs if x_m != x_h])
        numerator = (numerator * d_h + shares[h] * denominator) % PRIME
        denominator = denominator * d_h % PRIME
    return math.prod(xs) * numerator * pow(denominator, -1, PRIME) % PRIME
