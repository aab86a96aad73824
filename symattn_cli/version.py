"""The package version: a leaf module, so any layer may import it without importing the
package root (pyproject.toml reads it from here too)."""

__version__ = "0.1.0"
