//! The keyword side: a tantivy index of chunk texts on disk, scored with BM25. Each tantivy
//! document is one chunk: its id (fast field, to map hits back and to filter), its document's
//! id (raw term, to delete all of a document's chunks at once) and its analysed text (not
//! stored: the text lives in the store).

use std::collections::HashSet;
use std::path::Path;

use tantivy::collector::{FilterCollector, TopDocs};
use tantivy::query::{BooleanQuery, Occur, Query, TermQuery};
use tantivy::schema::{
    Field, IndexRecordOption, NumericOptions, Schema, TextFieldIndexing, TextOptions, STRING,
};
use tantivy::tokenizer::{
    Language, LowerCaser, RemoveLongFilter, SimpleTokenizer, Stemmer, StopWordFilter, TextAnalyzer,
};
use tantivy::{Index, IndexReader, IndexWriter, ReloadPolicy, TantivyDocument, Term};

use super::store::Store;
use super::{internal, SearchError};

const ANALYZER: &str = "gateway";
/// Distinct terms of one query that are scored; more cost CPU without changing the ranking much.
const MAX_QUERY_TERMS: usize = 256;

/// How text is analysed for BM25, fixed when the collection is created.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Analysis {
    /// A Snowball language (english, german, french, ...) for stemming and stop words.
    pub language: String,
    pub stemming: bool,
    pub stop_words: bool,
}

impl Default for Analysis {
    fn default() -> Self {
        Self {
            language: "english".into(),
            stemming: true,
            stop_words: true,
        }
    }
}

impl Analysis {
    fn language(&self) -> Result<Language, String> {
        let mut name = self.language.to_lowercase();
        if let Some(c) = name.get_mut(..1) {
            c.make_ascii_uppercase();
        }
        serde_json::from_value(serde_json::Value::String(name)).map_err(|_| {
            format!(
                "unknown language {:?} (one of arabic, danish, dutch, english, finnish, french, german, greek, hungarian, italian, norwegian, portuguese, romanian, russian, spanish, swedish, tamil, turkish)",
                self.language
            )
        })
    }

    pub fn validate(&self) -> Result<(), String> {
        self.language().map(drop)
    }

    fn analyzer(&self) -> Result<TextAnalyzer, String> {
        let lang = self.language()?;
        let mut b = TextAnalyzer::builder(SimpleTokenizer::default())
            .filter(RemoveLongFilter::limit(40))
            .filter(LowerCaser)
            .dynamic();
        if self.stop_words {
            if let Some(f) = StopWordFilter::new(lang) {
                b = b.filter_dynamic(f);
            }
        }
        if self.stemming {
            b = b.filter_dynamic(Stemmer::new(lang));
        }
        Ok(b.build())
    }
}

pub struct Bm25 {
    index: Index,
    writer: parking_lot::Mutex<IndexWriter>,
    reader: IndexReader,
    chunk: Field,
    doc: Field,
    text: Field,
}

impl Bm25 {
    /// Opens the index in `dir`, creating it when there is none.
    pub fn open(dir: &Path, analysis: &Analysis) -> tantivy::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut schema = Schema::builder();
        schema.add_u64_field("chunk", NumericOptions::default().set_indexed().set_fast());
        schema.add_text_field("doc", STRING);
        schema.add_text_field(
            "text",
            TextOptions::default().set_indexing_options(
                TextFieldIndexing::default()
                    .set_tokenizer(ANALYZER)
                    .set_index_option(IndexRecordOption::WithFreqs),
            ),
        );
        let schema = schema.build();
        let index = Index::open_or_create(
            tantivy::directory::MmapDirectory::open(dir)?,
            schema.clone(),
        )?;
        let analyzer = analysis
            .analyzer()
            .map_err(tantivy::TantivyError::InvalidArgument)?;
        index.tokenizers().register(ANALYZER, analyzer);
        // One indexing thread: ingest is bound by embedding, and 2 cores serve requests too.
        let writer = index.writer_with_num_threads(1, 32 << 20)?;
        let reader = index
            .reader_builder()
            .reload_policy(ReloadPolicy::Manual)
            .try_into()?;
        let field = |n| schema.get_field(n);
        Ok(Self {
            chunk: field("chunk")?,
            doc: field("doc")?,
            text: field("text")?,
            index,
            writer: parking_lot::Mutex::new(writer),
            reader,
        })
    }

    /// Opens the index in `dir` and brings it in step with `store`: an unreadable index is
    /// rebuilt, writes the store logged but the index may have missed (a crash between the
    /// two) are replayed, and an index that still does not hold exactly the store's `stored`
    /// chunks (lost, replaced, an older copy) is rebuilt rather than left serving wrong results.
    pub fn recover(
        dir: &Path,
        collection: &str,
        analysis: &Analysis,
        store: &mut Store,
        stored: usize,
    ) -> Result<Self, SearchError> {
        let (db, index) = (internal("collection store"), internal("BM25 index"));
        let bm25 = match Bm25::open(dir, analysis) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(collection, error = %e, "BM25 index unreadable; rebuilding it");
                let _ = std::fs::remove_dir_all(dir);
                Bm25::open(dir, analysis).map_err(|e| index(&e))?
            }
        };
        let pending = store.pending().map_err(|e| db(&e))?;
        if !pending.is_empty() {
            tracing::info!(
                collection,
                documents = pending.len(),
                "replaying writes into the BM25 index"
            );
            let mut rows = Vec::new();
            for d in &pending {
                for (id, text) in store.doc_chunks(d).map_err(|e| db(&e))? {
                    rows.push((id, d.clone(), text));
                }
            }
            let rows: Vec<_> = rows.iter().map(|(i, d, t)| (*i, &d[..], &t[..])).collect();
            bm25.apply(&pending, &rows).map_err(|e| index(&e))?;
            store.clear_pending(&pending).map_err(|e| db(&e))?;
        }
        if bm25.num_chunks() != stored as u64 {
            tracing::warn!(
                collection,
                indexed = bm25.num_chunks(),
                stored,
                "BM25 index out of step with the store; rebuilding it"
            );
            let all = store.all_texts().map_err(|e| db(&e))?;
            bm25.clear().map_err(|e| index(&e))?;
            let rows: Vec<_> = all.iter().map(|(i, d, t)| (*i, &d[..], &t[..])).collect();
            bm25.apply(&[], &rows).map_err(|e| index(&e))?;
        }
        Ok(bm25)
    }

    /// Removes every chunk of `docs`, adds `chunks` as (chunk id, doc id, text), commits
    /// durably and makes the result visible to searches.
    pub fn apply(&self, docs: &[String], chunks: &[(u64, &str, &str)]) -> tantivy::Result<()> {
        let mut writer = self.writer.lock();
        let mut run = || -> tantivy::Result<()> {
            for d in docs {
                writer.delete_term(Term::from_field_text(self.doc, d));
            }
            for &(id, doc, text) in chunks {
                let mut d = TantivyDocument::default();
                d.add_u64(self.chunk, id);
                d.add_text(self.doc, doc);
                d.add_text(self.text, text);
                writer.add_document(d)?;
            }
            writer.commit().map(drop)
        };
        if let Err(e) = run() {
            // Nothing of a failed batch may ride along with the next commit.
            let _ = writer.rollback();
            return Err(e);
        }
        self.reader.reload()
    }

    /// Drops everything (before a full rebuild from the store).
    pub fn clear(&self) -> tantivy::Result<()> {
        let mut writer = self.writer.lock();
        writer.delete_all_documents()?;
        writer.commit()?;
        self.reader.reload()
    }

    /// The best `k` chunks for a free-text query as (chunk id, BM25 score), optionally only
    /// among `allowed`. The query is analysed like the documents and its terms OR-ed: no query
    /// syntax, so user text can never be a syntax error.
    pub fn search(
        &self,
        query: &str,
        k: usize,
        allowed: Option<&std::sync::Arc<HashSet<u64>>>,
    ) -> tantivy::Result<Vec<(u64, f32)>> {
        let mut analyzer = self.index.tokenizer_for_field(self.text)?;
        let mut terms = Vec::new();
        let mut seen = HashSet::new();
        let mut stream = analyzer.token_stream(query);
        while let Some(t) = stream.next() {
            if terms.len() == MAX_QUERY_TERMS {
                break;
            }
            if seen.insert(t.text.clone()) {
                terms.push(Term::from_field_text(self.text, &t.text));
            }
        }
        if terms.is_empty() || k == 0 {
            return Ok(Vec::new());
        }
        let q: Box<dyn Query> = Box::new(BooleanQuery::new(
            terms
                .into_iter()
                .map(|t| {
                    let q: Box<dyn Query> =
                        Box::new(TermQuery::new(t, IndexRecordOption::WithFreqs));
                    (Occur::Should, q)
                })
                .collect(),
        ));
        let searcher = self.reader.searcher();
        let top = TopDocs::with_limit(k).order_by_score();
        let hits = match allowed {
            Some(set) => {
                let set = set.clone();
                let filter =
                    FilterCollector::new("chunk".into(), move |id: u64| set.contains(&id), top);
                searcher.search(&q, &filter)?
            }
            None => searcher.search(&q, &top)?,
        };
        hits.into_iter()
            .map(|(score, addr)| {
                let id = searcher
                    .segment_reader(addr.segment_ord)
                    .fast_fields()
                    .u64("chunk")?
                    .first(addr.doc_id)
                    .ok_or_else(|| tantivy::TantivyError::InternalError("chunk id".into()))?;
                Ok((id, score))
            })
            .collect()
    }

    pub fn num_chunks(&self) -> u64 {
        self.reader.searcher().num_docs()
    }
}
