"""For a tool parser's tests: its whole output fed in small pieces, as the server streams it."""

from __future__ import annotations

from engine.interfaces import ToolCall, ToolParser


def parse_in_pieces(parser: ToolParser, text: str, piece: int) -> tuple[str, list[ToolCall]]:
    """(the content, the calls) ``parser`` gives for ``text`` fed ``piece`` characters at a time
    and then finished."""
    content, calls = "", list[ToolCall]()
    for at in range(0, len(text), piece):
        more, done = parser.feed(text[at : at + piece])
        content, calls = content + more, calls + done
    more, done = parser.finish()
    return content + more, calls + done
