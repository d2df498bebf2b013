"""The search tool of verl's example configs (`verl.tools.search_tool.SearchTool`), over a local corpus file instead
of a retrieval server: BM25 ranking by the `bm25s` library (`pip install 'posttrain[agents]'`).

Config: `corpus_path` (required; a relative path is read from the tool YAML's folder): a JSONL file, one document a
line, with its text under `contents` (the layout of
the Search-R1 / FlashRAG corpora verl's retriever serves: the first line is the title) or `text` (with an optional
`title`); `topk` (3). The call's `query_list` is answered like verl's: {"result": "Doc 1 (Title: ...)\\n<text>\\n\\n
Doc 2 ..."} with the queries' results joined by "\\n---\\n". Documents that share no term with a query are not
returned."""

from __future__ import annotations

import json
import os

from ..stateful import BaseTool, ToolResponse


def read_corpus(path: str) -> list[tuple[str, str]]:
    """(title, text) of each document of a JSONL corpus."""
    docs = []
    with open(os.path.expanduser(path), encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if isinstance(row.get("contents"), str):
                title, _, text = row["contents"].partition("\n")
            elif isinstance(row.get("text"), str):
                title, text = str(row.get("title", "")), row["text"]
            else:
                raise ValueError(f"{path}:{number}: a document needs a `contents` or `text` string")
            docs.append((title.strip(), text.strip()))
    if not docs:
        raise ValueError(f"{path}: the corpus has no documents")
    return docs


class SearchTool(BaseTool):
    default_schema = {"type": "function", "function": {
        "name": "search", "description": "Searches the web for relevant information based on the given query.",
        "parameters": {"type": "object", "properties": {"query_list": {
            "type": "array", "items": {"type": "string"},
            "description": "A list of fully-formed semantic queries. The tool will return search results for each "
                           "query."}}, "required": ["query_list"]}}}

    def __init__(self, config: dict, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        try:
            import bm25s
        except ImportError:
            raise ImportError("the search tool ranks with the bm25s library: pip install 'posttrain[agents]'") from None
        if not self.config.get("corpus_path"):
            raise ValueError("the search tool searches a local corpus: set config.corpus_path to a JSONL file of "
                             "{\"contents\": \"title\\ntext\"} documents (a retrieval_service_url is not used)")
        self.topk = int(self.config.get("topk", 3))
        self.docs = read_corpus(self.config["corpus_path"])
        self._bm25s = bm25s
        self.index = bm25s.BM25()
        self.index.index(self._tokens([f"{title}\n{text}" for title, text in self.docs]), show_progress=False)

    def _tokens(self, texts: list[str]):
        """Words (not ids: a query's ids would be its own vocabulary's), stop words dropped."""
        return self._bm25s.tokenize(texts, stopwords="en", show_progress=False, return_ids=False)

    def search(self, query: str) -> list[tuple[str, str]]:
        """The best `topk` documents for a query (those with a positive score)."""
        found, scores = self.index.retrieve(self._tokens([query]), k=min(self.topk, len(self.docs)),
                                            show_progress=False, n_threads=1)
        return [self.docs[int(i)] for i, s in zip(found[0], scores[0]) if s > 0]

    def execute(self, instance_id: str, parameters: dict, **kwargs):
        queries = parameters.get("query_list")
        if not queries or not isinstance(queries, list):
            return ToolResponse(text=json.dumps({"result": "Error: 'query_list' is missing, empty, or not a list "
                                                           "in parameters."})), 0.0, {}
        blocks = []
        for query in queries:
            docs = self.search(str(query))
            blocks.append("\n\n".join(f"Doc {k} (Title: {title})\n{text}" for k, (title, text) in enumerate(docs, 1)))
        found = sum(bool(b) for b in blocks)
        result = "\n---\n".join(blocks) if found else "No search results found."
        return ToolResponse(text=json.dumps({"result": result}, ensure_ascii=False)), 0.0, {"query_count": len(queries)}
