"""Where the tests find the checkout: its root and the shipped weights."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = ROOT / "weights"
