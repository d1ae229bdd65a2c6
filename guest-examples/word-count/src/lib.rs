//! Word count over a text column: the one example that brings data into the guest.
//!
//! - `count` (one task per partition of the source): copies the `text` column into the guest
//!   (an explicit, counted copy), splits it into lower-case words there, hands the words back to
//!   the host as a column and counts them with a host group-by;
//! - `merge`: sums the counts, most frequent first (ties alphabetically).
//!
//! The column is named by the job parameter `column` (default `text`).

use wrk_sdk::Values;
use wrk_sdk::prelude::*;

struct WordCount;

impl Task for WordCount {
    fn run(inputs: Vec<Table>) -> Result<Vec<Table>> {
        let output = match context::stage_name().as_str() {
            "count" => count_words(&inputs)?,
            "merge" => {
                if inputs.is_empty() {
                    return Err(Error::msg("stage `merge` received no partial tables"));
                }
                Table::concat(&inputs)?
                    .group_by(["word"])
                    .agg([sum("n").alias("n")])?
                    .sort([desc("n"), asc("word")])?
            }
            other => {
                return Err(Error::msg(format!(
                    "word-count has no stage `{other}` (its stages are `count` and `merge`)"
                )));
            }
        };
        Ok(vec![output])
    }
}

wrk_sdk::export_task!(WordCount);

fn count_words(inputs: &[Table]) -> Result<Table> {
    let table = inputs
        .first()
        .ok_or_else(|| Error::msg("stage `count` expects a table with a text column"))?;
    let column = context::param("column").unwrap_or_else(|| "text".to_string());
    let values = table.column(&column)?.to_values()?;
    let Values::Utf8(texts) = values.values else {
        return Err(Error::msg(format!(
            "column `{column}` is not a text column"
        )));
    };
    let validity = values.validity;
    let mut words = Vec::new();
    for (row, text) in texts.iter().enumerate() {
        if validity.as_ref().is_some_and(|v| !v[row]) {
            continue;
        }
        words.extend(
            text.split(|c: char| !c.is_alphanumeric() && c != '\'')
                .filter(|w| !w.is_empty())
                .map(str::to_lowercase),
        );
    }
    let words = Column::from_strings("word", &words)?;
    Table::from_columns([&words])?
        .group_by(["word"])
        .agg([count("word").alias("n")])
}
