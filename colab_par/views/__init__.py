"""Pictures drawn from plain rows wherever they are shown: the live dashboard, its SVG plots, and how an engine's view reaches the notebook."""
