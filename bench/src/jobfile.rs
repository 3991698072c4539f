//! fio job files: INI syntax with `[global]` and one section per job.
//!
//! - `[name]` starts a section; `key=value` or a bare `key` (a flag) fill it.
//! - Lines starting with `;` or `#` are comments, as is anything after
//!   whitespace followed by `;` or `#`.
//! - `${VAR}` is replaced by the environment variable `VAR` (fio's
//!   environment expansion); an unset variable is an error.
//! - Options before the first section are an error, as in fio.

/// One `key[=value]` line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub key: String,
    pub value: Option<String>,
    /// 1-based line number, for messages.
    pub line: usize,
}

/// One `[section]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Section {
    pub name: String,
    pub entries: Vec<Entry>,
}

fn strip_comment(line: &str) -> &str {
    let t = line.trim();
    if t.starts_with(';') || t.starts_with('#') {
        return "";
    }
    let bytes = t.as_bytes();
    for i in 1..bytes.len() {
        if (bytes[i] == b';' || bytes[i] == b'#') && bytes[i - 1].is_ascii_whitespace() {
            return t[..i].trim_end();
        }
    }
    t
}

fn expand_env(s: &str, line: usize) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(p) = rest.find("${") {
        out.push_str(&rest[..p]);
        let after = &rest[p + 2..];
        let end = after.find('}').ok_or_else(|| format!("line {line}: unterminated ${{"))?;
        let var = &after[..end];
        let val = std::env::var(var).map_err(|_| format!("line {line}: environment variable {var} is not set"))?;
        out.push_str(&val);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Parses a job file's text into its sections, in order.
pub fn parse(text: &str) -> Result<Vec<Section>, String> {
    let mut sections: Vec<Section> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let t = strip_comment(raw);
        if t.is_empty() {
            continue;
        }
        if let Some(rest) = t.strip_prefix('[') {
            let name = rest
                .strip_suffix(']')
                .ok_or_else(|| format!("line {line}: section header {t:?} lacks a closing ]"))?
                .trim();
            if name.is_empty() {
                return Err(format!("line {line}: empty section name"));
            }
            sections.push(Section { name: name.to_owned(), entries: Vec::new() });
            continue;
        }
        let t = expand_env(t, line)?;
        let (key, value) = match t.split_once('=') {
            Some((k, v)) => (k.trim().to_owned(), Some(v.trim().to_owned())),
            None => (t.trim().to_owned(), None),
        };
        if key.is_empty() {
            return Err(format!("line {line}: missing option name in {t:?}"));
        }
        let section = sections
            .last_mut()
            .ok_or_else(|| format!("line {line}: option {key:?} outside of a section (start with [global] or [jobname])"))?;
        section.entries.push(Entry { key, value, line });
    }
    Ok(sections)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fio_syntax() {
        let text = "; a comment\n# another\n[global]\nbs=4k\ntime_based\nruntime=2 ; trailing\n\n[job1]\nrw=randread\n[job2]\nrw = write\n";
        let s = parse(text).unwrap();
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].name, "global");
        assert_eq!(s[0].entries[1], Entry { key: "time_based".into(), value: None, line: 5 });
        assert_eq!(s[0].entries[2].value.as_deref(), Some("2"));
        assert_eq!(s[2].entries[0].key, "rw");
        assert_eq!(s[2].entries[0].value.as_deref(), Some("write"));
    }

    #[test]
    fn errors_name_the_line() {
        assert!(parse("bs=4k\n").unwrap_err().contains("line 1"));
        assert!(parse("[x\n").unwrap_err().contains("line 1"));
        assert!(parse("[a]\nx=${RDMABLK_BENCH_SURELY_UNSET}\n").unwrap_err().contains("RDMABLK_BENCH_SURELY_UNSET"));
    }

    #[test]
    fn expands_environment() {
        let s = parse("[a]\nfilename=${HOME}/x\n").unwrap();
        let home = std::env::var("HOME").unwrap();
        assert_eq!(s[0].entries[0].value.as_deref(), Some(format!("{home}/x").as_str()));
    }
}
