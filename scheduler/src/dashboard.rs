//! The live web dashboard on the scheduler's HTTP port: one page embedded in the binary (HTML,
//! CSS and JavaScript, nothing fetched from elsewhere) that polls small JSON endpoints.
//!
//! - `GET /` the page; `/static/*` its script and style.
//! - `GET /api/workers` workers with their memory, device and assigned tasks.
//! - `GET /api/jobs` unfinished jobs and the most recent finished ones, with stage progress.
//! - `GET /api/tasks?since=N&limit=M` task executions after cursor `N` (without `since`: the
//!   newest `M`); the answer's `next` is the cursor to ask with next time.
//! - `GET /api/transfers?since=N&limit=M` partition transfers between workers, likewise.
//!
//! Every answer is built from counters and bounded rings under the state's lock and serialised
//! after it, so a dashboard costs the scheduler the same with a million tasks as with ten.

use std::sync::{Arc, Mutex, MutexGuard};

use axum::Router;
use axum::extract::Query;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::state::State;

/// The page.
pub const INDEX_HTML: &str = include_str!("dashboard/index.html");
/// The dashboard's script.
pub const DASHBOARD_JS: &str = include_str!("dashboard/dashboard.js");
/// Drawing of task streams and time series, shared with `wrk submit --report`.
pub const TIMELINE_JS: &str = include_str!("dashboard/timeline.js");
/// The style sheet, shared with `wrk submit --report`.
pub const STYLE_CSS: &str = include_str!("dashboard/style.css");

/// Records a page carries when the query names no limit.
const DEFAULT_LIMIT: usize = 2_000;

/// Query of the cursor endpoints.
#[derive(Debug, Default, serde::Deserialize)]
struct CursorQuery {
    since: Option<u64>,
    limit: Option<usize>,
}

impl CursorQuery {
    fn limit(&self) -> usize {
        self.limit.unwrap_or(DEFAULT_LIMIT).max(1)
    }

    /// The cursor to read from: the one given, or the newest `limit` records' first.
    fn cursor(&self, end: u64) -> u64 {
        self.since
            .unwrap_or_else(|| end.saturating_sub(self.limit() as u64))
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type)], body).into_response()
}

/// JSON that must not be cached: it changes every poll.
fn live<T: serde::Serialize>(value: T) -> Response {
    ([(header::CACHE_CONTROL, "no-store")], axum::Json(value)).into_response()
}

/// The dashboard's routes, over the scheduler's state.
pub fn router(state: Arc<Mutex<State>>) -> Router {
    let workers = state.clone();
    let jobs = state.clone();
    let tasks = state.clone();
    let transfers = state;
    Router::new()
        .route(
            "/",
            get(|| async { asset("text/html; charset=utf-8", INDEX_HTML) }),
        )
        .route(
            "/static/dashboard.js",
            get(|| async { asset("text/javascript; charset=utf-8", DASHBOARD_JS) }),
        )
        .route(
            "/static/timeline.js",
            get(|| async { asset("text/javascript; charset=utf-8", TIMELINE_JS) }),
        )
        .route(
            "/static/style.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE_CSS) }),
        )
        .route(
            "/api/workers",
            get(move || {
                let view = lock(&workers).workers_view();
                async move { live(view) }
            }),
        )
        .route(
            "/api/jobs",
            get(move || {
                let view = lock(&jobs).jobs_view();
                async move { live(view) }
            }),
        )
        .route(
            "/api/tasks",
            get(move |Query(query): Query<CursorQuery>| {
                let view = {
                    let state = lock(&tasks);
                    let cursor = query.cursor(state.executions_end());
                    state.executions_view(cursor, query.limit())
                };
                async move { live(view) }
            }),
        )
        .route(
            "/api/transfers",
            get(move |Query(query): Query<CursorQuery>| {
                let view = {
                    let state = lock(&transfers);
                    let cursor = query.cursor(state.transfers_end());
                    state.transfers_view(cursor, query.limit())
                };
                async move { live(view) }
            }),
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_without_cursor_reads_the_newest_records() {
        let query = CursorQuery {
            since: None,
            limit: Some(10),
        };
        assert_eq!(query.cursor(25), 15);
        assert_eq!(query.cursor(3), 0);
        let query = CursorQuery {
            since: Some(7),
            limit: None,
        };
        assert_eq!((query.cursor(25), query.limit()), (7, DEFAULT_LIMIT));
    }

    #[test]
    fn the_page_loads_only_its_own_assets() {
        for (name, text) in [
            ("index.html", INDEX_HTML),
            ("dashboard.js", DASHBOARD_JS),
            ("timeline.js", TIMELINE_JS),
            ("style.css", STYLE_CSS),
        ] {
            for external in ["http://", "https://", "//cdn", "@import"] {
                assert!(!text.contains(external), "{name} refers to {external}");
            }
        }
        assert!(INDEX_HTML.contains("static/dashboard.js"));
        assert!(INDEX_HTML.contains("static/timeline.js"));
        assert!(INDEX_HTML.contains("static/style.css"));
    }
}
