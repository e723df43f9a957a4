//! `sparda report`: the benchmark report from result files (runtime.md §5).

use crate::ReportArgs;
use sparda::{Error, Result};

pub(crate) fn cmd_report(a: ReportArgs) -> Result<()> {
    let loaded = sparda::report::load_inputs(&a.inputs)?;
    let md = sparda::report::write_report(&loaded, &a.out)?;
    print!("{md}");
    eprintln!(
        "report: {} rows from {} inputs; {}.json, .md, .svg written",
        loaded.rows.len(),
        a.inputs.len(),
        a.out.display()
    );
    if let Some(readme) = &a.readme {
        let text = std::fs::read_to_string(readme).map_err(|e| Error::io(readme, e))?;
        let what = readme.display().to_string();
        let new = sparda::report::replace_between_markers(&text, &md, &what)?;
        std::fs::write(readme, new).map_err(|e| Error::io(readme, e))?;
        eprintln!("report: {} updated between its markers", readme.display());
    }
    Ok(())
}
