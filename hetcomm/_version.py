"""hetcomm's version, in a module of its own so that any floor can read it without importing the
package face (``hetcomm/__init__.py`` registers the backend and re-exports the public API).
Keep it equal to ``pyproject.toml``'s ``version`` (``tests/test_architecture.py`` checks)."""

__version__ = "0.1.0"
