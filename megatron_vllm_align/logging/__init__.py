"""Logging for people: TensorBoard gradient-contract panels (tags listed in docs/panels.md)."""
from .tensorboard import PANELS, Panel, PanelWriter, panels_markdown

__all__ = ["PANELS", "Panel", "PanelWriter", "panels_markdown"]
