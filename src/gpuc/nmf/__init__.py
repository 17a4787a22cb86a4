"""Consensus NMF engine (pure arrays, no AnnData): batched HALS restarts, consensus, k sweep."""
