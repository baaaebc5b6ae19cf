//! Reading trace files: JSON (`Trace` as the engine serialises it), optionally gzipped.

use std::path::Path;

use burn_caching_alloc::alloc::Trace;
use replay::{BUILTIN_NAMES, NamedTrace, builtin_trace};

/// Loads `path` (`.json` or `.json.gz`), named after the file; a path that is not a file but
/// a built-in trace's name (`transformer-varlen`, ...) is that trace.
pub fn load_trace(path: &Path) -> Result<NamedTrace, String> {
    if !path.exists()
        && let Some(name) = path.to_str()
        && let Some(trace) = builtin_trace(name)
    {
        return Ok(NamedTrace {
            name: name.to_string(),
            trace,
        });
    }
    if !path.exists() {
        return Err(format!(
            "{}: no such file, and not a built-in trace ({})",
            path.display(),
            BUILTIN_NAMES.join(", ")
        ));
    }
    let trace = Trace::read_file(path).map_err(|e| e.to_string())?;
    Ok(NamedTrace {
        name: trace_name(path),
        trace,
    })
}

/// The file name without `.gz` and `.json`.
fn trace_name(path: &Path) -> String {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    let name = name.strip_suffix(".gz").unwrap_or(&name);
    name.strip_suffix(".json").unwrap_or(name).to_string()
}
