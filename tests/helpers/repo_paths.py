"""The one definition of where the checkout and the committed fixtures are, for every test file."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
RECIPES = REPO / "recipes"
