"""The search tool of verl's example configs (`verl.tools.search_tool.SearchTool`): over verl's retrieval server, or
over a local corpus file.

Config (exactly one of the two sources):
- `retrieval_service_url`: a retrieval server answering verl's request (retrieval.py), as verl's tool calls it, with
  verl's keys `timeout` (30 s; here for the whole call, retries included), `num_workers` (120) and `rate_limit`
  (120; `enable_global_rate_limit`, True): at most min(num_workers, rate_limit) requests in flight from this process
  (verl's rate limit is one for the whole cluster), and posttrain's `max_response_bytes` (16 MiB).
- `corpus_path` (a relative path is read from the tool YAML's folder): a JSONL file, one document a line, with its
  text under `contents` (the layout of the Search-R1 / FlashRAG corpora verl's retriever serves: the first line is
  the title) or `text` (with an optional `title`), ranked with BM25 by the `bm25s` library (`pip install
  'posttrain[agents]'`). Documents that share no term with a query are not returned.
Both: `topk` (3). The call's `query_list` is answered like verl's: {"result": "Doc 1 (Title: ...)\\n<text>\\n\\n
Doc 2 ..."} with the queries' results joined by "\\n---\\n". A server that fails (down, slow, an answer that is not
verl's layout or is too big) makes the call a counted tool error whose message the model reads."""

from __future__ import annotations

import json
import os
import urllib.parse

from ..stateful import BaseTool, ToolResponse
from .retrieval import RetrievalClient

SERVER_KEYS = {"retrieval_service_url": None, "timeout": 30, "num_workers": 120, "rate_limit": 120,
               "enable_global_rate_limit": True, "max_response_bytes": 16 << 20}
COMMON_KEYS = {"type": "native", "topk": 3}


def config_problem(config: dict) -> str | None:
    """What is wrong with a search tool's `config` (read at load, nothing contacted), or None."""
    if not isinstance(config, dict):
        return f"config must be a mapping of settings, got {type(config).__name__}"
    url, corpus = config.get("retrieval_service_url"), config.get("corpus_path")
    if bool(url) == bool(corpus):
        return ("set exactly one of config.retrieval_service_url (a retrieval server answering verl's search "
                "request) and config.corpus_path (a local JSONL corpus of {\"contents\": \"title\\ntext\"} "
                f"documents, ranked with BM25); got {'both' if url else 'neither'}")
    known = set(COMMON_KEYS) | (set(SERVER_KEYS) if url else {"corpus_path"})
    unknown = sorted(set(config) - known)
    if unknown:
        server_only = [k for k in unknown if k in SERVER_KEYS]
        return (f"config key(s) {unknown} are not read by the search tool"
                + (f" ({', '.join(server_only)} apply to a retrieval server, not to corpus_path)" if server_only
                   else "") + f"; it reads {sorted(known)}")
    if url:
        parts = urllib.parse.urlsplit(str(url))
        try:
            parts.port
        except ValueError as e:
            return f"config.retrieval_service_url={url!r}: {e}"
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return f"config.retrieval_service_url={url!r} is not an http:// or https:// URL"
    for key, low in (("topk", 1), ("num_workers", 1), ("rate_limit", 1), ("max_response_bytes", 1)):
        value = config.get(key, low)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            return f"config.{key}={value!r} must be an integer >= {low}"
    timeout = config.get("timeout", 1)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        return f"config.timeout={timeout!r} must be a positive number of seconds"
    if not isinstance(config.get("enable_global_rate_limit", True), bool):
        return f"config.enable_global_rate_limit={config['enable_global_rate_limit']!r} must be true or false"
    return None


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
        problem = config_problem(self.config)
        if problem:
            raise ValueError(f"the search tool: {problem}")
        settings = COMMON_KEYS | (SERVER_KEYS if self.config.get("retrieval_service_url") else {}) | self.config
        self.topk = settings["topk"]
        self.client = None
        if settings.get("retrieval_service_url"):
            limit = settings["rate_limit"] if settings["enable_global_rate_limit"] else settings["num_workers"]
            self.client = RetrievalClient(settings["retrieval_service_url"], timeout_s=float(settings["timeout"]),
                                          max_response_bytes=settings["max_response_bytes"],
                                          concurrency=min(settings["num_workers"], limit))
            return
        try:
            import bm25s
        except ImportError:
            raise ImportError("the search tool ranks a local corpus with the bm25s library: "
                              "pip install 'posttrain[agents]'") from None
        self.docs = read_corpus(self.config["corpus_path"])
        self._bm25s = bm25s
        self.index = bm25s.BM25()
        self.index.index(self._tokens([f"{title}\n{text}" for title, text in self.docs]), show_progress=False)

    def _tokens(self, texts: list[str]):
        """Words (not ids: a query's ids would be its own vocabulary's), stop words dropped."""
        return self._bm25s.tokenize(texts, stopwords="en", show_progress=False, return_ids=False)

    def search(self, query: str) -> list[tuple[str, str]]:
        """The best `topk` documents of the local corpus for a query (those with a positive score)."""
        found, scores = self.index.retrieve(self._tokens([query]), k=min(self.topk, len(self.docs)),
                                            show_progress=False, n_threads=1)
        return [self.docs[int(i)] for i, s in zip(found[0], scores[0]) if s > 0]

    def execute(self, instance_id: str, parameters: dict, **kwargs):
        queries = parameters.get("query_list")
        if not queries or not isinstance(queries, list):
            return ToolResponse(text=json.dumps({"result": "Error: 'query_list' is missing, empty, or not a list "
                                                           "in parameters."})), 0.0, {}
        queries = [str(q) for q in queries]
        if self.client is not None:  # a failure raises: the session answers and counts it
            result, found = self.client.search(queries, self.topk)
            metrics = {"query_count": len(queries), "total_results": found}
        else:
            blocks = ["\n\n".join(f"Doc {k} (Title: {title})\n{text}" for k, (title, text) in
                                  enumerate(self.search(query), 1)) for query in queries]
            result = "\n---\n".join(blocks) if any(blocks) else "No search results found."
            metrics = {"query_count": len(queries)}
        return ToolResponse(text=json.dumps({"result": result}, ensure_ascii=False)), 0.0, metrics
