"""Offline, license-clean English training text for the bundled demo model (``train_demo.py``).

Sources (each optional; whatever is installed is used, in this order):

* ``python-docs``: the CPython documentation as Debian's ``python3.11-doc`` package installs it
  (HTML under ``/usr/share/doc/python3.11/html``), stripped to plain text, one document per page.
  License: PSF License Agreement (code examples since 3.8.6 also Zero-Clause BSD).
* ``python-docs-qa``: chat dialogs derived from the same pages: every glossary entry
  (``glossary.html``) and every documented function, class, method and exception of the library
  reference become "What is X?" / "What does X do?" questions answered with the entry's text.
  Same license as ``python-docs`` (a mechanical derivative).
* ``pydoc-topics``: the standard library's ``pydoc_data.topics`` (79 language-reference topics,
  PSF license); used only when the HTML documentation is not installed.
* ``chatterbot``: the English YAML dialogs of the PyPI package ``chatterbot-corpus`` (1.3.x;
  BSD-3-Clause per its upstream ``pyproject.toml``; user-contributed conversations), turned into
  alternating user/assistant turns as ChatterBot itself reads them.

Chat dialogs are rendered with the demo chat template (``<|role|>\\n`` + content per message,
no separators), the way ``ChatTokenizer.apply_chat_template`` renders them; a conversation ends
where the document ends (the trainer appends ``<|endoftext|>``).

Held-out split: deterministic and leak-free. The unit is the source page (a docs page together
with every dialog derived from it; a pydoc topic; a chatterbot conversation). Units are ordered by
the SHA-256 of their name and taken into the held-out set in that order until it holds
``fraction`` of the characters of its source.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

__all__ = [
    "DOCS_CANDIDATES",
    "SOURCES",
    "Corpus",
    "Document",
    "Message",
    "build_corpus",
    "chatterbot_dialogs",
    "find_python_docs",
    "html_to_text",
    "pydoc_topics",
    "python_docs",
    "render_chat",
]

Message = dict[str, str]

DOCS_CANDIDATES: tuple[str, ...] = (
    "/usr/share/doc/python3.11/html",
    "/usr/share/doc/python3/html",
    "/usr/share/doc/python3.12/html",
    "/usr/share/doc/python3.13/html",
)

SOURCES: dict[str, dict[str, str]] = {
    "python-docs": {
        "what": "CPython 3.11 documentation (Debian package python3.11-doc), HTML stripped to text",
        "license": "PSF License Agreement (examples also 0BSD)",
    },
    "python-docs-qa": {
        "what": "Q/A dialogs built from the same docs: glossary entries and API entries",
        "license": "PSF License Agreement (derived from python-docs)",
    },
    "pydoc-topics": {
        "what": "CPython's pydoc_data.topics (fallback when python3.11-doc is absent)",
        "license": "PSF License Agreement",
    },
    "chatterbot": {
        "what": "chatterbot-corpus (PyPI) English dialog YAML files",
        "license": "BSD-3-Clause",
    },
}

# Pages that are indexes, changelogs or legal boilerplate rather than prose.
_SKIP_PAGES = re.compile(
    r"^(genindex.*|py-modindex|search|contents|copyright|license|download|bugs|about)\.html$"
    r"|^whatsnew/changelog\.html$"
)
_SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a helpful assistant.",
    "You are a helpful assistant who answers questions about Python.",
    "Answer briefly and accurately.",
)
_BLOCK_TAGS = frozenset(
    "p div section article dl dt dd ul ol li table thead tbody tr h1 h2 h3 h4 h5 h6 "
    "blockquote caption figure figcaption aside".split()
)
_SKIP_TAGS = frozenset({"script", "style", "head", "title", "nav", "footer"})
_VOID_TAGS = frozenset(
    "area base br col embed hr img input link meta param source track wbr".split()
)
_MAX_ANSWER_CHARS = 900


@dataclass(frozen=True)
class Document:
    """One training document: ``text`` is final (chat dialogs are already rendered)."""

    source: str
    unit: str  # the held-out split unit (page / topic / conversation id)
    name: str
    text: str
    chat: bool


@dataclass
class Corpus:
    """Documents split into train and held-out, plus per-source statistics."""

    train: list[Document] = field(default_factory=list)
    held_out: list[Document] = field(default_factory=list)
    stats: dict[str, dict[str, int]] = field(default_factory=dict)

    def sources(self) -> list[str]:
        """The sources that contributed at least one document."""
        return sorted(self.stats)


# ----------------------------------------------------------------------------- HTML -> text


@dataclass
class _Node:
    tag: str
    attrs: dict[str, str]
    children: list[_Node | str] = field(default_factory=list)

    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def find_all(self, tag: str, cls: str | None = None) -> Iterator[_Node]:
        """Descendants (pre-order) with this tag (and CSS class)."""
        for child in self.children:
            if isinstance(child, _Node):
                if child.tag == tag and (cls is None or cls in child.classes()):
                    yield child
                yield from child.find_all(tag, cls)

    def direct(self, tag: str) -> list[_Node]:
        return [c for c in self.children if isinstance(c, _Node) and c.tag == tag]


class _TreeBuilder(HTMLParser):
    """A forgiving HTML -> ``_Node`` tree builder (Sphinx output is well-formed)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = _Node("#root", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = _Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in _VOID_TAGS:
            self.stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(_Node(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)


def _parse(html: str) -> _Node:
    builder = _TreeBuilder()
    builder.feed(html)
    builder.close()
    return builder.root


class _TextWriter:
    """Renders a node tree as plain text: paragraphs separated by blank lines, code kept."""

    def __init__(self) -> None:
        self.blocks: list[str] = []
        self.inline: list[str] = []
        self.prefix = ""

    def flush(self) -> None:
        text = re.sub(r"\s+", " ", "".join(self.inline)).strip()
        self.inline = []
        if text:
            self.blocks.append(self.prefix + text)
            self.prefix = ""

    def walk(self, node: _Node | str) -> None:
        if isinstance(node, str):
            self.inline.append(node)
            return
        if node.tag in _SKIP_TAGS or "headerlink" in node.classes():
            return
        if node.tag == "pre":
            self.flush()
            code = _raw_text(node).strip("\n")
            if code.strip():
                self.blocks.append(code.rstrip())
            return
        if node.tag == "br":
            self.inline.append(" ")
            return
        block = node.tag in _BLOCK_TAGS
        if block:
            self.flush()
            if node.tag == "li":
                self.prefix = "- "
        for child in node.children:
            self.walk(child)
        if node.tag in ("td", "th"):
            self.inline.append(" ")
        if block:
            self.flush()

    def text(self) -> str:
        self.flush()
        return "\n\n".join(self.blocks)


def _raw_text(node: _Node | str) -> str:
    if isinstance(node, str):
        return node
    if "headerlink" in node.classes():
        return ""
    return "".join(_raw_text(c) for c in node.children)


def _inline_text(node: _Node | str) -> str:
    return re.sub(r"\s+", " ", _raw_text(node)).strip()


def _render(node: _Node) -> str:
    writer = _TextWriter()
    writer.walk(node)
    return writer.text()


def _main_body(root: _Node) -> _Node:
    for div in root.find_all("div", "body"):
        if div.attrs.get("role") == "main":
            return div
    return root


def html_to_text(html: str) -> str:
    """Plain text of a Sphinx HTML page's main body (navigation, ``¶`` anchors dropped)."""
    return _render(_main_body(_parse(html)))


# ----------------------------------------------------------------------------- sources


def find_python_docs(candidates: Iterable[str | Path] = DOCS_CANDIDATES) -> Path | None:
    """The first installed CPython HTML documentation root (has ``glossary.html``), if any."""
    for cand in candidates:
        path = Path(cand)
        if (path / "glossary.html").is_file() and (path / "library").is_dir():
            return path
    return None


def _stable_hash(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")


def _system_for(name: str) -> list[Message]:
    """A system message for about a third of the dialogs (deterministic by name)."""
    h = _stable_hash("system:" + name)
    if h % 3 != 0:
        return []
    return [{"role": "system", "content": _SYSTEM_PROMPTS[(h // 3) % len(_SYSTEM_PROMPTS)]}]


def render_chat(messages: Sequence[Message]) -> str:
    """The demo chat template: ``<|role|>\\n`` + content for each message, concatenated."""
    return "".join(f"<|{m['role']}|>\n{m['content']}" for m in messages)


def _article(term: str) -> str:
    return "an" if term[:1].lower() in "aeiou" else "a"


def _glossary_dialogs(root: _Node) -> list[tuple[str, list[Message]]]:
    out: list[tuple[str, list[Message]]] = []
    for dl in root.find_all("dl", "glossary"):
        term: str | None = None
        for child in dl.children:
            if not isinstance(child, _Node):
                continue
            if child.tag == "dt":
                term = _inline_text(child)
            elif child.tag == "dd" and term:
                answer = _clip(_render(child))
                if not answer:
                    continue
                if term[:1].isalpha():
                    questions = [
                        f"What is {_article(term)} {term} in Python?",
                        f"What does {term} mean?",
                        f"Explain {term}.",
                    ]
                else:
                    questions = [f"What does {term} mean in Python?"]
                for i, q in enumerate(questions):
                    name = f"glossary:{term}:{i}"
                    msgs = [*_system_for(name), {"role": "user", "content": q}]
                    msgs.append({"role": "assistant", "content": answer})
                    out.append((name, msgs))
                term = None
    return out


_API_KINDS = {
    "function": ("What does {n}() do?", "How do I use {n}() in Python?"),
    "method": ("What does the {n}() method do?",),
    "class": ("What is the {n} class?", "What is {n} used for?"),
    "exception": ("When is {n} raised?",),
}


def _api_dialogs(root: _Node, page: str) -> list[tuple[str, list[Message]]]:
    out: list[tuple[str, list[Message]]] = []
    for kind, templates in _API_KINDS.items():
        for dl in root.find_all("dl", kind):
            if "py" not in dl.classes():
                continue
            dts, dds = dl.direct("dt"), dl.direct("dd")
            if not dts or not dds:
                continue
            ident = dts[0].attrs.get("id", "")
            signature = _inline_text(dts[0])
            paragraphs = [_inline_text(p) for p in dds[0].direct("p")]
            paragraphs = [p for p in paragraphs if p]
            if not ident or not paragraphs:
                continue
            answer = _clip("\n\n".join([signature, *paragraphs[:2]]))
            name_only = ident.rsplit(".", 1)[-1] if kind == "method" else ident
            for i, template in enumerate(templates):
                name = f"api:{page}:{ident}:{i}"
                question = template.format(n=name_only)
                msgs = [*_system_for(name), {"role": "user", "content": question}]
                msgs.append({"role": "assistant", "content": answer})
                out.append((name, msgs))
    return out


def _clip(text: str, limit: int = _MAX_ANSWER_CHARS) -> str:
    """Cut at a sentence or paragraph end before ``limit`` characters."""
    text = text.strip()
    if len(text) <= limit:
        return text
    cut = max(text.rfind(". ", 0, limit), text.rfind("\n", 0, limit))
    return text[: cut + 1].strip() if cut > limit // 3 else text[:limit].rstrip()


def python_docs(docs_root: Path, max_pages: int | None = None) -> list[Document]:
    """Documents of the CPython HTML docs: one prose document per page plus its Q/A dialogs."""
    docs: list[Document] = []
    pages = sorted(p for p in docs_root.rglob("*.html") if not p.name.startswith("_"))
    pages = [p for p in pages if not _SKIP_PAGES.match(p.relative_to(docs_root).as_posix())]
    pages = [p for p in pages if not p.relative_to(docs_root).parts[0].startswith("_")]
    if max_pages is not None:
        pages = pages[:max_pages]
    for path in pages:
        rel = path.relative_to(docs_root).as_posix()
        unit = f"docs:{rel}"
        root = _parse(path.read_text(encoding="utf-8", errors="replace"))
        body = _main_body(root)
        text = _render(body)
        if len(text) >= 200:
            docs.append(Document("python-docs", unit, unit, text, chat=False))
        dialogs = _glossary_dialogs(body) if rel == "glossary.html" else []
        if rel.startswith(("library/", "reference/")):
            dialogs += _api_dialogs(body, rel)
        for name, msgs in dialogs:
            docs.append(Document("python-docs-qa", unit, name, render_chat(msgs), chat=True))
    return docs


def pydoc_topics() -> list[Document]:
    """CPython's ``pydoc_data.topics`` (language reference excerpts), one document per topic."""
    from pydoc_data.topics import topics

    return [
        Document("pydoc-topics", f"topic:{k}", f"topic:{k}", topics[k].strip(), chat=False)
        for k in sorted(topics)
        if topics[k].strip()
    ]


def chatterbot_dialogs() -> list[Document]:
    """English chatterbot-corpus conversations as chat documents ([] if not installed)."""
    try:
        import chatterbot_corpus
        import yaml
    except ImportError:
        return []
    data = Path(chatterbot_corpus.__file__).parent / "data" / "english"
    docs: list[Document] = []
    for path in sorted(data.glob("*.yml")):
        loaded: Any = yaml.safe_load(path.read_text(encoding="utf-8"))
        convs = loaded.get("conversations", []) if isinstance(loaded, dict) else []
        for i, conv in enumerate(convs):
            turns = [str(t).strip() for t in conv if str(t).strip()]
            if len(turns) < 2:
                continue
            name = f"chatterbot:{path.stem}:{i}"
            msgs = list(_system_for(name))
            for j, turn in enumerate(turns):
                msgs.append({"role": "user" if j % 2 == 0 else "assistant", "content": turn})
            if msgs[-1]["role"] == "user":  # end on an answer
                msgs.pop()
            docs.append(Document("chatterbot", name, name, render_chat(msgs), chat=True))
    return docs


# ----------------------------------------------------------------------------- corpus


def _split(docs: list[Document], fraction: float) -> tuple[list[Document], list[Document]]:
    """Leak-free held-out split by unit, per source (see the module docstring)."""
    held_units: set[str] = set()
    by_source: dict[str, dict[str, int]] = {}
    for d in docs:
        units = by_source.setdefault(d.source, {})
        units[d.unit] = units.get(d.unit, 0) + len(d.text)
    for source in sorted(by_source):
        units = by_source[source]
        total = sum(units.values())
        taken = 0
        for unit in sorted(units, key=lambda u: (_stable_hash(u), u)):
            if taken >= fraction * total:
                break
            if source == "python-docs" and units[unit] > 4 * fraction * total:
                continue  # one giant page would make the held-out set a single topic
            held_units.add(unit)
            taken += units[unit]
    train = [d for d in docs if d.unit not in held_units]
    held = [d for d in docs if d.unit in held_units]
    return train, held


def build_corpus(
    docs_root: Path | str | None = "auto",
    *,
    use_chatterbot: bool = True,
    held_out_fraction: float = 0.02,
    max_pages: int | None = None,
) -> Corpus:
    """Collect every available source and split it (deterministic for the same inputs).

    ``docs_root="auto"`` looks for an installed CPython HTML documentation
    (:data:`DOCS_CANDIDATES`); ``None`` skips it. Without it, ``pydoc_data.topics`` is used.
    ``max_pages`` limits the docs pages read (for tests).
    """
    root = find_python_docs() if docs_root == "auto" else (Path(docs_root) if docs_root else None)
    docs: list[Document] = []
    if root is not None:
        docs += python_docs(root, max_pages=max_pages)
    if not any(d.source == "python-docs" for d in docs):
        docs += pydoc_topics()
    if use_chatterbot:
        docs += chatterbot_dialogs()
    train, held = _split(docs, held_out_fraction)
    corpus = Corpus(train=train, held_out=held)
    for split, items in (("train", train), ("held_out", held)):
        for d in items:
            s = corpus.stats.setdefault(
                d.source,
                {"train_docs": 0, "train_chars": 0, "held_out_docs": 0, "held_out_chars": 0},
            )
            s[f"{split}_docs"] += 1
            s[f"{split}_chars"] += len(d.text)
    return corpus
