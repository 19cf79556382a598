import pytest

from dflash.bottleneck import WaitShares, verdict


@pytest.mark.parametrize(
    ("shares", "expected"),
    [
        (WaitShares(0.02, 0.01, 0.41), "drafters waited 41% on hs_queue: target-bound"),
        (WaitShares(0.02, 0.55, 0.03), "drafter-bound; add drafter devices"),
        (WaitShares(0.60, 0.00, 0.50), "input-bound"),
        (WaitShares(0.30, 0.00, 0.05), "targets waited 30% on batch_queue: input-bound"),
        (WaitShares(0.05, 0.04, 0.10), "balanced: no stage waited more than 10%"),
    ],
)
def test_verdict_names_the_bottleneck(shares: WaitShares, expected: str) -> None:
    assert expected in verdict(shares)


def test_threshold_moves_the_line() -> None:
    shares = WaitShares(0.0, 0.0, 0.12)
    assert verdict(shares).startswith("balanced")
    assert "target-bound" in verdict(shares, threshold=0.10)
