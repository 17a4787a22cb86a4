# Regenerates legal_design_pasilla_R.csv.gz (tests/core/test_inputs_designs.py) with R DESeq2 (Debian
# r-base-core + r-bioc-deseq2, DESeq2 1.38.3):
#   Rscript tests/data/deseq/make_legal_design_reference.R src/gpuc/datasets/data tests/data/deseq
# Pasilla, every 10th gene; a design R accepts but that is awkward in Python: a logical column (`treated`) and an
# integer-coded factor (`lanes2`: 1 when the sample was sequenced on 2 lanes, factor levels "0" and "1").
suppressMessages(library(DESeq2))
args <- commandArgs(trailingOnly = TRUE)
src <- args[1]; out <- args[2]
cts <- as.matrix(read.csv(gzfile(file.path(src, "pasilla_counts.csv.gz")), row.names = 1))
cts <- cts[seq(1, nrow(cts), by = 10), ]
md <- read.csv(file.path(src, "pasilla_metadata.csv"), row.names = 1, check.names = FALSE)
md <- md[colnames(cts), ]
cd <- data.frame(
  treated = md$condition == "treated",
  lanes2 = factor(as.integer(md[["number of lanes"]] == 2)),
  row.names = rownames(md)
)
dds <- DESeqDataSetFromMatrix(cts, cd, ~ lanes2 + treated)
dds <- DESeq(dds, quiet = TRUE)
cat("coefficients:", resultsNames(dds), "\n")
res_t <- as.data.frame(results(dds, name = "treatedTRUE"))
res_l <- as.data.frame(results(dds, contrast = c("lanes2", "1", "0")))
keep <- c("baseMean", "log2FoldChange", "lfcSE", "stat", "pvalue", "padj")
colnames(res_t) <- paste0("treated_", colnames(res_t))
colnames(res_l) <- paste0("lanes2_", colnames(res_l))
both <- cbind(res_t[, paste0("treated_", keep)], res_l[, paste0("lanes2_", keep)])
write.csv(signif(both, 8), gzfile(file.path(out, "legal_design_pasilla_R.csv.gz")))
