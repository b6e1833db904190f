"""For a tool parser's tests: its whole output fed in small pieces, as the server streams it,
and the checks that a parser streaming its calls (``MarkedToolParser.partial_calls``) gives
them argument by argument."""

from __future__ import annotations

from collections.abc import Callable

from engine.interfaces import ArgumentsDelta, CallPieces, ToolCall, ToolParser, join_calls


def stream_in_pieces(parser: ToolParser, text: str, piece: int) -> tuple[str, CallPieces]:
    """(the content, the call pieces in order) ``parser`` gives for ``text`` fed ``piece``
    characters at a time and then finished."""
    content, pieces = "", CallPieces()
    for at in range(0, len(text), piece):
        more, done = parser.feed(text[at : at + piece])
        content, pieces = content + more, pieces + done
    more, done = parser.finish()
    return content + more, pieces + done


def parse_in_pieces(parser: ToolParser, text: str, piece: int) -> tuple[str, list[ToolCall]]:
    """(the content, the whole calls) ``parser`` gives for ``text`` fed ``piece`` characters at
    a time and then finished."""
    content, pieces = stream_in_pieces(parser, text, piece)
    return content, join_calls(pieces)


def per_call(pieces: CallPieces) -> list[CallPieces]:
    """The pieces grouped by call: each group a :class:`ToolCall` and its argument deltas."""
    groups: list[CallPieces] = []
    for piece in pieces:
        if isinstance(piece, ToolCall):
            groups.append([piece])
        else:
            groups[-1].append(piece)
    return groups


def check_streamed(
    make_parser: Callable[[], ToolParser], text: str, several: tuple[int, ...] = (0,)
) -> tuple[str, list[ToolCall]]:
    """Checks that ``text`` streams the same content and calls fed a character at a time, a few
    characters (about a token) at a time and whole (the non-streamed answer), and that fed by
    characters the calls at ``several`` (with more than one argument) begin with their name
    before their arguments are complete and then get them in more than one delta.
    -> (the content, the calls) fed whole, for the test's own check of their values."""
    whole = parse_in_pieces(make_parser(), text, max(1, len(text)))
    for piece in (1, 3, 4, 7):
        assert parse_in_pieces(make_parser(), text, piece) == whole, f"fed {piece} at a time"
    groups = per_call(stream_in_pieces(make_parser(), text, 1)[1])
    assert [g[0].name for g in groups if isinstance(g[0], ToolCall)] == [c.name for c in whole[1]]
    for i in several:
        head, deltas = groups[i][0], [p for p in groups[i][1:] if isinstance(p, ArgumentsDelta)]
        assert isinstance(head, ToolCall) and len(head.arguments) < len(whole[1][i].arguments), i
        assert len(deltas) > 1, f"call {i}: {len(deltas)} argument deltas"
    return whole
