"""Tool-call output formats, one `<name>_format.py` module each, and their shared helpers.

Formats register themselves with `registry.register_tool_format`; the `tool_calls`
stage loads them all (`registry.load_builtin_formats`). See docs/extending.md.
"""
