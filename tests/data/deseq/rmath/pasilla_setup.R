# Shared by make_irls_reference.R and make_optim_reference.R (sourced from this folder): DESeq2, the hex writer,
# pasilla's counts, metadata and ~type + condition model matrix (folder given on the command line), R's IRLS and
# its gene table.
suppressMessages(library(DESeq2))
args <- commandArgs(trailingOnly = TRUE)
src <- if (length(args)) args[1] else "/work/shared/data/bulk/pasilla"
hx <- function(v) sprintf("%a", v)
cts <- as.matrix(read.csv(file.path(src, "counts.csv"), row.names = 1, check.names = FALSE))
md <- read.csv(file.path(src, "metadata.csv"), row.names = 1)
md$condition <- factor(md$condition, levels = c("untreated", "treated"))
md$type <- factor(md$type)
design <- ~type + condition
mm <- model.matrix(design, md)

# R's QR start (fitNbinomGLMs') and fitBeta's IRLS for the genes of dds at dispersions alpha: list(b0, nf, fit)
irls_fit <- function(dds, alpha) {
  y <- counts(dds)
  qrx <- qr(mm)
  b0 <- t(solve(qr.R(qrx), t(qr.Q(qrx)) %*% t(log(counts(dds, normalized = TRUE) + .1))))
  nf <- matrix(rep(sizeFactors(dds), each = nrow(y)), ncol = ncol(y))
  fit <- DESeq2:::fitBetaWrapper(ySEXP = y, xSEXP = mm, nfSEXP = nf, alpha_hatSEXP = alpha, beta_matSEXP = b0,
    lambdaSEXP = rep(1e-6, ncol(mm)) / log(2)^2, weightsSEXP = matrix(1, nrow(y), ncol(y)), useWeightsSEXP = FALSE,
    tolSEXP = 1e-8, maxitSEXP = 100, useQRSEXP = TRUE, minmuSEXP = 0.5)
  list(b0 = b0, nf = nf, fit = fit)
}

# A gene table of dds: counts y1.., size factors sf1.., alpha, R's start b0_.., the IRLS coefficients beta_.. (natural
# log) and iterations, all doubles as hex; `ir` is irls_fit(dds, alpha)
irls_table <- function(dds, alpha, ir) {
  y <- counts(dds)
  out <- data.frame(gene = rownames(dds))
  for (j in seq_len(ncol(y))) out[[paste0("y", j)]] <- y[, j]
  for (j in seq_len(ncol(y))) out[[paste0("sf", j)]] <- hx(sizeFactors(dds)[j])
  out$alpha <- hx(alpha)
  for (k in seq_len(ncol(mm))) out[[paste0("b0_", k)]] <- hx(ir$b0[, k])
  for (k in seq_len(ncol(mm))) out[[paste0("beta_", k)]] <- hx(ir$fit$beta_mat[, k])
  out$iter <- ir$fit$iter
  out
}
