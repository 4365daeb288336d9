"""Before-launch and demonstration tools: the dry run, suggestions, drawings, the demo."""
