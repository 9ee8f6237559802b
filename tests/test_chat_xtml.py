"""XTML attribute escaping (k3serve/chat/xtml.py): values that look like escapes survive a round trip."""

import json

import pytest

from k3serve.chat import parse_output
from k3serve.chat.xtml import escape_attr, unescape_attr

O, C, S, EOM = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
TRICKY = ["&quot;", "&amp;", "&amp;quot;", '"&', '&"', "a&quot;b\"c&amp;d", "&&quot;;", ""]


@pytest.mark.parametrize("value", TRICKY)
def test_attribute_round_trip(value):
    escaped = escape_attr(value)
    assert '"' not in escaped and unescape_attr(escaped) == value


def test_literal_quot_entity_in_an_argument_key_is_parsed_back_literally():
    """A key whose text is `&quot;` (not a quote) must come back as those six characters: decoding
    `&quot;` before `&amp;` is what keeps `&amp;quot;` from turning into a quote."""
    key = 'say &quot;hi&quot; & "bye"'
    arg = f'{O}argument key="{escape_attr(key)}" type="string"{S}x{C}argument{S}'
    text = f'{O}tools{S}{O}call tool="f" index="1"{S}{arg}{C}call{S}{C}tools{S}{C}message{S}{EOM}'
    out = parse_output(text, thinking=False, tools_enabled=True)
    assert [json.loads(tc.arguments) for tc in out.tool_calls] == [{key: "x"}]
